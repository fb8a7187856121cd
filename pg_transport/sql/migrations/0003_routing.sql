-- 0003: routing state shared by every process (exchanges, bindings), queue expiry
-- and message TTL.

CREATE TABLE {schema}.exchange (
    name       text        PRIMARY KEY,
    type       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT exchange_type_check CHECK (type IN ('direct', 'topic', 'fanout'))
);

INSERT INTO {schema}.exchange (name, type) VALUES
    ('', 'direct'), ('amq.direct', 'direct'), ('amq.topic', 'topic'), ('amq.fanout', 'fanout');

-- pattern is the routing key as an anchored regular expression (topic exchanges).
CREATE TABLE {schema}.binding (
    exchange    text NOT NULL,
    queue       text NOT NULL,
    routing_key text NOT NULL,
    pattern     text NOT NULL,
    CONSTRAINT binding_pkey PRIMARY KEY (exchange, routing_key, queue)
);

CREATE INDEX binding_queue_idx ON {schema}.binding (queue);

-- A queue unused (no consumer touching it) for expires_ms is deleted, as AMQP's
-- x-expires; message_ttl_ms bounds how long its messages live (x-message-ttl).
ALTER TABLE {schema}.queue
    ADD COLUMN expires_ms     bigint,
    ADD COLUMN message_ttl_ms bigint,
    ADD COLUMN last_used      timestamptz NOT NULL DEFAULT now();

CREATE INDEX queue_expiring_idx ON {schema}.queue (last_used) WHERE expires_ms IS NOT NULL;

ALTER TABLE {schema}.message ADD COLUMN expires_at timestamptz;

CREATE INDEX message_expiring_idx ON {schema}.message (expires_at) WHERE expires_at IS NOT NULL;

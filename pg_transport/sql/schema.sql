-- The whole current schema of pgq. {schema} is composed as an identifier.
-- tests/integration/test_schema.py builds one database from this file and one
-- from migrations/ and diffs the catalogs: change both together.

CREATE TABLE {schema}.schema_version (
    version    integer     PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- A declared queue. Messages may exist for a queue that is not declared
-- (publishing to an undeclared queue keeps the message, as Redis does).
-- A queue unused (no consumer touching it) for expires_ms is deleted, as AMQP's
-- x-expires; message_ttl_ms bounds how long its messages live (x-message-ttl).
CREATE TABLE {schema}.queue (
    name           text        PRIMARY KEY,
    created_at     timestamptz NOT NULL DEFAULT now(),
    expires_ms     bigint,
    message_ttl_ms bigint,
    last_used      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX queue_expiring_idx ON {schema}.queue (last_used) WHERE expires_ms IS NOT NULL;

-- Routing state shared by every process. pattern is the routing key as an
-- anchored regular expression (topic exchanges).
CREATE TABLE {schema}.exchange (
    name       text        PRIMARY KEY,
    type       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT exchange_type_check CHECK (type IN ('direct', 'topic', 'fanout'))
);

INSERT INTO {schema}.exchange (name, type) VALUES
    ('', 'direct'), ('amq.direct', 'direct'), ('amq.topic', 'topic'), ('amq.fanout', 'fanout');

CREATE TABLE {schema}.binding (
    exchange    text NOT NULL,
    queue       text NOT NULL,
    routing_key text NOT NULL,
    pattern     text NOT NULL,
    CONSTRAINT binding_pkey PRIMARY KEY (exchange, routing_key, queue)
);

CREATE INDEX binding_queue_idx ON {schema}.binding (queue);

-- A message is a row; visible_at is its visibility timeout. read_ct counts
-- deliveries (max_attempts); lease counts grants (every claim and every release) and
-- is the fencing token of acks, releases, renewals and dead-lettering: a holder whose
-- message was released or claimed again can touch it no more.
CREATE TABLE {schema}.message (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue       text        NOT NULL,
    priority    smallint    NOT NULL DEFAULT 0,
    visible_at  timestamptz NOT NULL DEFAULT now(),
    read_ct     integer     NOT NULL DEFAULT 0,
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    publish_key text,
    payload     json        NOT NULL,
    expires_at  timestamptz,
    lease       integer     NOT NULL DEFAULT 0,
    CONSTRAINT message_publish_key_key UNIQUE (publish_key),
    CONSTRAINT message_priority_check CHECK (priority BETWEEN 0 AND 255)
) WITH (
    -- Vacuumed once 10,000 rows are dead however small the table, unthrottled.
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0,
    -- Half of each page is left free: a claim's new version of a row (about 1 kB for
    -- a Celery message) stays on its page, and the WAL carries only what changed.
    -- Last, as migration 0006 leaves it in the table's options.
    fillfactor = 50
);

-- Claim order within a queue: priority first, then the time a message became visible
-- (published, due, released or its lease lapsed), then arrival. Rows in flight or
-- delayed sort after the ready ones of their priority, so a claim never reads them.
CREATE INDEX message_claim_idx ON {schema}.message (queue, priority DESC, visible_at, id);

CREATE INDEX message_expiring_idx ON {schema}.message (expires_at) WHERE expires_at IS NOT NULL;

-- Poisoned, rejected and undecodable messages. Never silently deleted.
CREATE TABLE {schema}.dead_letter (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id  bigint      NOT NULL,
    queue       text        NOT NULL,
    priority    smallint    NOT NULL DEFAULT 0,
    read_ct     integer     NOT NULL,
    enqueued_at timestamptz NOT NULL,
    dead_at     timestamptz NOT NULL DEFAULT now(),
    reason      text        NOT NULL,
    task_id     text,
    task_name   text,
    identity    jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    hooks       jsonb       NOT NULL DEFAULT '[]'::jsonb,
    payload     json        NOT NULL
);

CREATE INDEX dead_letter_queue_idx ON {schema}.dead_letter (queue, id);

-- A fan-in barrier. remaining counts the parts not finished yet; the part that
-- takes it to 0 flips armed -> fired and inserts the callback message in the
-- same transaction. callback/errback are Celery signatures (JSON).
CREATE TABLE {schema}.barrier (
    id            text        PRIMARY KEY,
    status        text        NOT NULL DEFAULT 'armed',
    total         integer     NOT NULL,
    remaining     integer     NOT NULL,
    callback      json        NOT NULL,
    errback       json,
    metadata      jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    reason        text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    progressed_at timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL,
    stuck_timeout interval    NOT NULL,
    fired_at      timestamptz,
    finished_at   timestamptz,
    CONSTRAINT barrier_status_check
        CHECK (status IN ('armed', 'fired', 'completed', 'failed', 'expired')),
    CONSTRAINT barrier_remaining_check CHECK (remaining BETWEEN 0 AND total)
);

-- The sweep only ever looks at armed barriers.
CREATE INDEX barrier_armed_idx ON {schema}.barrier (expires_at) WHERE status = 'armed';

-- One row per finished part: the primary key is what makes a redelivered part
-- unable to count twice.
CREATE TABLE {schema}.barrier_part (
    barrier_id  text        NOT NULL REFERENCES {schema}.barrier (id) ON DELETE CASCADE,
    idx         integer     NOT NULL,
    task_id     text,
    outcome     text        NOT NULL,
    result      json,
    finished_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT barrier_part_pkey PRIMARY KEY (barrier_id, idx),
    CONSTRAINT barrier_part_outcome_check CHECK (outcome IN ('succeeded', 'failed'))
);

-- Guards: a claim with a lease. completed_at set = tombstone, never re-claimed;
-- token counts (re)claims and fences renew/complete/release of a stale holder.
CREATE TABLE {schema}.guard_claim (
    key          text        PRIMARY KEY,
    holder       text        NOT NULL,
    token        bigint      NOT NULL DEFAULT 1,
    lease_until  timestamptz NOT NULL,
    claimed_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz
);

-- Guards: a generation counter per key; every replace bumps it.
CREATE TABLE {schema}.guard_generation (
    key        text        PRIMARY KEY,
    generation bigint      NOT NULL,
    bumped_at  timestamptz NOT NULL DEFAULT now()
);

-- Periodic tasks (pg_transport.beat). A schedule entry: its schedule as JSON
-- ({{"every": seconds, "aligned": bool}} or {{"crontab": "m h dom mon dow"}}); its slots
-- are the times it falls due, counted from anchor. last_due is the latest slot sent (or
-- passed over): a slot is sent only if later, by the transaction that moves it, so two
-- beats can never both send one. revision counts the changes a sender must have seen.
CREATE TABLE {schema}.beat_entry (
    name         text        PRIMARY KEY,
    task         text        NOT NULL,
    schedule     jsonb       NOT NULL,
    args         jsonb       NOT NULL DEFAULT '[]'::jsonb,
    kwargs       jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    options      jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    enabled      boolean     NOT NULL DEFAULT true,
    origin       text        NOT NULL,
    anchor       timestamptz NOT NULL DEFAULT now(),
    revision     bigint      NOT NULL DEFAULT 1,
    last_due     timestamptz,
    last_sent_at timestamptz,
    sent_count   bigint      NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT beat_entry_origin_check CHECK (origin IN ('config', 'command'))
);

-- One row per slot sent: the primary key is what makes a slot impossible to send twice,
-- whatever the number of beats. Inserted in the transaction that inserts the message.
CREATE TABLE {schema}.beat_slot (
    entry   text        NOT NULL,
    due_at  timestamptz NOT NULL,
    task_id text        NOT NULL,
    sent_at timestamptz NOT NULL DEFAULT now(),
    sent_by text        NOT NULL,
    CONSTRAINT beat_slot_pkey PRIMARY KEY (entry, due_at)
);

CREATE INDEX beat_slot_due_idx ON {schema}.beat_slot (due_at);

-- The beat that does the work: one row, a lease its holder renews. Leadership only
-- saves work (the others stay idle); slots stay single whoever sends them.
CREATE TABLE {schema}.beat_leader (
    singleton   boolean     PRIMARY KEY DEFAULT true,
    holder      text        NOT NULL,
    term        bigint      NOT NULL DEFAULT 1,
    lease_until timestamptz NOT NULL,
    acquired_at timestamptz NOT NULL,
    renewed_at  timestamptz NOT NULL,
    CONSTRAINT beat_leader_singleton_check CHECK (singleton)
);

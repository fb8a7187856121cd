-- 0005: hand a message straight to an idle consumer.
-- A consumer whose last claim found less than it had room for waits here, one row per
-- queue. A publish takes the longest-waiting live consumer of its queue, inserts the
-- message already leased to it and sends it in a NOTIFY on that consumer's own channel:
-- the consumer starts the task without a claim round trip. consumer is the token of the
-- consumer's session, which holds the advisory lock (lock space of the schema, token)
-- for as long as it lives, so nothing is handed to a consumer that died.

CREATE TABLE {schema}.waiter (
    id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer integer     NOT NULL,
    queue    text        NOT NULL,
    vt       float8      NOT NULL,
    since    timestamptz NOT NULL DEFAULT now()
) WITH (
    -- Every hand-off deletes a row and the consumer's next short claim inserts one.
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE INDEX waiter_queue_idx ON {schema}.waiter (queue, id);

CREATE INDEX waiter_consumer_idx ON {schema}.waiter (consumer);

-- 0009: the web console's samples (`pgq web`). See schema.sql for what each table means.

-- The web console's history (`pgq web`): one tick per sampling interval, taken by
-- whichever console inserts it first (the primary key makes the tick single however many
-- consoles run), with the message table's cumulative inserted and deleted row counts
-- (Postgres' statistics) from which the charts' rates are computed.
CREATE TABLE {schema}.console_tick (
    at        timestamptz PRIMARY KEY,
    taken_at  timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    inserted  bigint,
    deleted   bigint
);

-- Per queue and tick: the figures of `pgq status`. Kept for an hour and a bit.
CREATE TABLE {schema}.console_sample (
    at               timestamptz NOT NULL
                                 REFERENCES {schema}.console_tick (at) ON DELETE CASCADE,
    queue            text        NOT NULL,
    ready            bigint      NOT NULL,
    in_flight        bigint      NOT NULL,
    delayed          bigint      NOT NULL,
    dead             bigint      NOT NULL,
    oldest_ready_age float8,
    CONSTRAINT console_sample_pkey PRIMARY KEY (at, queue)
);

-- 0008: periodic tasks (pg_transport.beat): schedule entries, the slots sent, and the
-- lease of the beat that does the work. See schema.sql for what each table means.

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

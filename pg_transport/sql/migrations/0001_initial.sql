-- 0001: the first schema of pgq.

CREATE TABLE {schema}.schema_version (
    version    integer     PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- A declared queue. Messages may exist for a queue that is not declared
-- (publishing to an undeclared queue keeps the message, as Redis does).
CREATE TABLE {schema}.queue (
    name       text        PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- A message is a row; visible_at is its visibility timeout. read_ct counts
-- deliveries and is the fencing token of acks and releases.
CREATE TABLE {schema}.message (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue       text        NOT NULL,
    priority    smallint    NOT NULL DEFAULT 0,
    visible_at  timestamptz NOT NULL DEFAULT now(),
    read_ct     integer     NOT NULL DEFAULT 0,
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    publish_key text,
    payload     json        NOT NULL,
    CONSTRAINT message_publish_key_key UNIQUE (publish_key),
    CONSTRAINT message_priority_check CHECK (priority BETWEEN 0 AND 255)
) WITH (fillfactor = 90);

-- Claim order within a queue: priority first, then arrival.
CREATE INDEX message_claim_idx ON {schema}.message (queue, priority DESC, id);

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

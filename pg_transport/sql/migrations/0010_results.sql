-- 0010: the result backend (result_backend = "pgq://…").
-- A task's state is one row keyed by its id: the meta Celery stores (status, result,
-- traceback, children, task_extended fields) encoded with the result serializer,
-- possibly compressed, with its content type so a reader decodes what a writer wrote.
-- status, date_done and expires_at are columns so that SQL can judge a row without
-- decoding it: a SUCCESS is never overwritten, expired rows are reaped by index.
CREATE TABLE {schema}.result (
    task_id          text        PRIMARY KEY,
    status           text        NOT NULL,
    content_type     text        NOT NULL,
    content_encoding text        NOT NULL,
    meta             bytea       NOT NULL,
    date_done        timestamptz,
    expires_at       timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX result_expiring_idx ON {schema}.result (expires_at) WHERE expires_at IS NOT NULL;

-- A saved GroupResult (GroupResult.save / restore).
CREATE TABLE {schema}.result_group (
    group_id         text        PRIMARY KEY,
    content_type     text        NOT NULL,
    content_encoding text        NOT NULL,
    meta             bytea       NOT NULL,
    expires_at       timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX result_group_expiring_idx ON {schema}.result_group (expires_at)
    WHERE expires_at IS NOT NULL;

-- 0014: the result backend reads, forgets and keeps groups through functions that take ids.
-- Results are read, forgotten and grouped by id only, through these functions: a role
-- allowed them (a publisher waiting for its tasks) reaches the results whose ids it
-- holds and cannot list any other. A role that could read the table could learn a
-- chord's header ids and group id, and publish a part of that chord under one of those
-- ids, which a worker would run and count (a SUCCESS is never replaced, so the forged
-- value would stand). Each runs as the owner, with names resolved in pg_catalog only.
CREATE FUNCTION {schema}.result_read(ids text[])
RETURNS TABLE (task_id text, status text, content_type text, content_encoding text,
               meta bytea, updated_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT r.task_id, r.status, r.content_type, r.content_encoding, r.meta, r.updated_at
    FROM {schema}.result AS r
    WHERE r.task_id = ANY(ids)
$$;

CREATE FUNCTION {schema}.result_forget(id text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM {schema}.result AS r WHERE r.task_id = id
$$;

-- Saving a group again replaces it (GroupResult.save).
CREATE FUNCTION {schema}.result_group_save(
    id text, content_type text, content_encoding text, meta bytea, expires float8
) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO {schema}.result_group AS g
        (group_id, content_type, content_encoding, meta, expires_at)
    VALUES (id, content_type, content_encoding, meta,
            pg_catalog.now() + pg_catalog.make_interval(secs => expires))
    ON CONFLICT (group_id) DO UPDATE
    SET content_type = excluded.content_type,
        content_encoding = excluded.content_encoding,
        meta = excluded.meta,
        expires_at = excluded.expires_at
$$;

CREATE FUNCTION {schema}.result_group_read(id text)
RETURNS TABLE (content_type text, content_encoding text, meta bytea)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT g.content_type, g.content_encoding, g.meta
    FROM {schema}.result_group AS g
    WHERE g.group_id = id
$$;

CREATE FUNCTION {schema}.result_group_delete(id text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM {schema}.result_group AS g WHERE g.group_id = id
$$;

-- Postgres lets PUBLIC execute a new function: these are granted by name
-- (docs/least-privilege.md, docs/results.md).
REVOKE ALL ON FUNCTION {schema}.result_read(text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.result_forget(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.result_group_save(text, text, text, bytea, float8) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.result_group_read(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.result_group_delete(text) FROM PUBLIC;

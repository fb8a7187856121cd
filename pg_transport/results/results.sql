-- Named queries of the result backend. Each block starts with "-- name: <name>" and a
-- one-line description; {schema} is composed as an identifier, values are bound.
-- Loaded with loader.load_named("results.sql", schema, "pg_transport.results").

-- name: result_store
-- Store a task's state. A SUCCESS already stored is never replaced (a lost worker's late
-- update, or a redelivery's STARTED, must not hide a finished result); no row returned then.
INSERT INTO {schema}.result AS r
    (task_id, status, content_type, content_encoding, meta, date_done, expires_at, updated_at)
VALUES (%(task_id)s, %(status)s, %(content_type)s, %(content_encoding)s, %(meta)s,
        %(date_done)s,
        pg_catalog.now() + pg_catalog.make_interval(secs => %(expires)s::float8),
        pg_catalog.now())
ON CONFLICT (task_id) DO UPDATE
SET status = excluded.status,
    content_type = excluded.content_type,
    content_encoding = excluded.content_encoding,
    meta = excluded.meta,
    date_done = excluded.date_done,
    expires_at = excluded.expires_at,
    updated_at = excluded.updated_at
WHERE r.status <> 'SUCCESS'
RETURNING r.status

-- name: result_notify
-- Wake the waiters of one task: the channel names it, the payload is empty.
SELECT pg_catalog.pg_notify(%(channel)s::text, '')

-- name: result_get
-- One task's stored state. Reads go through result_read, which takes ids (schema.sql).
SELECT status, content_type, content_encoding, meta
FROM {schema}.result_read(ARRAY[%(task_id)s::text])

-- name: result_get_many
-- The stored states of many tasks (every waiter of a process in one statement).
SELECT task_id, status, content_type, content_encoding, meta, updated_at
FROM {schema}.result_read(%(ids)s::text[])

-- name: result_forget
-- Delete one task's state.
SELECT {schema}.result_forget(%(task_id)s::text)

-- name: group_save
-- Save a GroupResult (its member ids, encoded); saving again replaces it.
SELECT {schema}.result_group_save(
    %(group_id)s::text, %(content_type)s::text, %(content_encoding)s::text, %(meta)s::bytea,
    %(expires)s::float8
)

-- name: group_get
-- One saved GroupResult.
SELECT content_type, content_encoding, meta FROM {schema}.result_group_read(%(group_id)s::text)

-- name: group_delete
-- Delete a saved GroupResult.
SELECT {schema}.result_group_delete(%(group_id)s::text)

-- name: result_reap
-- Delete up to limit results and groups past their expiry. Rows another reaper (or a
-- store) holds are skipped, not waited for: every worker may reap at once.
WITH due AS (
    SELECT task_id FROM {schema}.result
    WHERE expires_at <= pg_catalog.now()
    ORDER BY expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {schema}.result AS r USING due WHERE r.task_id = due.task_id
    RETURNING 1
), due_groups AS (
    SELECT group_id FROM {schema}.result_group
    WHERE expires_at <= pg_catalog.now()
    ORDER BY expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone_groups AS (
    DELETE FROM {schema}.result_group AS g USING due_groups
    WHERE g.group_id = due_groups.group_id
    RETURNING 1
)
SELECT (SELECT pg_catalog.count(*) FROM gone), (SELECT pg_catalog.count(*) FROM gone_groups)

-- name: result_reset
-- Forget the states of tasks whose messages go back to their queues (PENDING again).
DELETE FROM {schema}.result WHERE task_id = ANY(%(ids)s::text[])

-- name: chord_part_record
-- Record a chord part once, at its task id's place in the header (the chord's metadata
-- lists the header's ids); a redelivered part, an unknown chord or a task that is not
-- one of its parts inserts nothing.
INSERT INTO {schema}.barrier_part (barrier_id, idx, task_id, outcome, result)
SELECT b.id, (e.ord - 1)::integer, %(task_id)s, %(outcome)s, %(result)s::json
FROM {schema}.barrier AS b
CROSS JOIN LATERAL pg_catalog.jsonb_array_elements_text(b.metadata -> 'ids')
    WITH ORDINALITY AS e(task_id, ord)
WHERE b.id = %(id)s AND e.task_id = %(task_id)s
ON CONFLICT (barrier_id, idx) DO NOTHING
RETURNING idx

-- name: chord_results
-- The header's stored results in part order, for the chord's body.
SELECT p.task_id, r.status, r.content_type, r.content_encoding, r.meta
FROM {schema}.barrier_part AS p
LEFT JOIN {schema}.result AS r ON r.task_id = p.task_id
WHERE p.barrier_id = %(id)s AND p.outcome = 'succeeded'
ORDER BY p.idx

-- name: chord_callback
-- A chord's body (a Celery signature as JSON text).
SELECT callback::text FROM {schema}.barrier WHERE id = %(id)s

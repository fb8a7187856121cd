-- Named queries of `pgq dead`: inspecting, requeueing and purging dead-letter rows.
-- Each block starts with "-- name: <name>" and a one-line description; {schema} is
-- composed as an identifier, values are bound.

-- name: dead_list
-- Dead-letter rows, newest first, optionally of one queue; total is the count before LIMIT.
SELECT d.id, d.queue, d.task_name, d.task_id, d.identity, d.reason, d.read_ct, d.dead_at,
       d.hooks, pg_catalog.count(*) OVER () AS total
FROM {schema}.dead_letter AS d
WHERE %(queue)s::text IS NULL OR d.queue = %(queue)s::text
ORDER BY d.id DESC
LIMIT %(limit)s

-- name: dead_requeue
-- Move dead-letter rows back into their queues in one statement: delivered afresh
-- (read_ct 0, visible now, same priority and payload), listeners woken. The DELETE and
-- the INSERT commit together, so a row is never in both tables nor in neither. The new
-- rows get no publish_key: the original one may be taken again by then. A task's
-- result that its dead-lettering failed (pgq's result backend) is PENDING again: the
-- task is queued once more. Returns one row per queue with the dead-letter ids moved
-- into it.
WITH moved AS (
    DELETE FROM {schema}.dead_letter AS d
    WHERE (%(all)s OR d.id = ANY(%(ids)s::bigint[]))
      AND (%(queue)s::text IS NULL OR d.queue = %(queue)s::text)
    RETURNING d.id, d.queue, d.priority, d.enqueued_at, d.payload, d.task_id
), pending AS (
    DELETE FROM {schema}.result AS r
    USING moved
    WHERE r.task_id = moved.task_id AND r.status <> 'SUCCESS'
), requeued AS (
    -- A message of an ordering key goes back to the end of its key (0011_ordering.sql).
    INSERT INTO {schema}.message
        (queue, priority, visible_at, read_ct, enqueued_at, payload, okey, task_id)
    SELECT moved.queue, moved.priority, pg_catalog.now(), 0, moved.enqueued_at, moved.payload,
           k.okey, CASE WHEN k.okey IS NOT NULL THEN COALESCE(moved.task_id, k.task_id) END
    FROM moved
    CROSS JOIN LATERAL (
        SELECT h.headers ->> 'pgq-ordering-key' AS okey, h.headers ->> 'id' AS task_id
        FROM (SELECT CASE WHEN pg_catalog.json_typeof(moved.payload) = 'object'
                           AND pg_catalog.json_typeof(moved.payload -> 'headers') = 'object'
                          THEN moved.payload -> 'headers' END AS headers) AS h
    ) AS k
    ORDER BY moved.id
)
SELECT q.queue, q.ids,
       pg_catalog.pg_notify(
           %(channel_prefix)s::text || pg_catalog.md5(pg_catalog.convert_to(q.queue, 'UTF8')),
           '')
FROM (
    SELECT moved.queue, pg_catalog.array_agg(moved.id ORDER BY moved.id) AS ids
    FROM moved GROUP BY moved.queue
) AS q
ORDER BY q.queue

-- name: dead_purge
-- Delete dead-letter rows dead for longer than older_than seconds (all when NULL),
-- optionally of one queue; return how many.
WITH purged AS (
    DELETE FROM {schema}.dead_letter AS d
    WHERE (%(older_than)s::float8 IS NULL
           OR d.dead_at
              < pg_catalog.now() - pg_catalog.make_interval(secs => %(older_than)s::float8))
      AND (%(queue)s::text IS NULL OR d.queue = %(queue)s::text)
    RETURNING 1
)
SELECT pg_catalog.count(*) FROM purged

-- name: dead_record_hooks
-- Replace the recorded hook outcomes of a dead-letter row (a rehook's are the news).
UPDATE {schema}.dead_letter SET hooks = %(hooks)s WHERE id = %(id)s

-- Named queries of `pgq delayed`. Each block starts with "-- name: <name>" and a
-- one-line description; {schema} is composed as an identifier, values are bound.

-- name: delayed
-- Messages waiting in Postgres for their ETA (native delayed delivery: never delivered,
-- not visible yet) in the given queues (every queue when none is given), soonest first,
-- at most limit of them, with what Celery's headers say of each: task id, task name,
-- ETA, the repr of its arguments (as text; NULL where there is no such header). Reads
-- payloads: the monitor role, which may not, is refused. A message a claim parked
-- (due_at set: behind an earlier one of its ordering key, or a follower waiting for its
-- predecessor) waits for no ETA, and is not listed.
SELECT m.queue, m.visible_at, m.priority,
       m.payload OPERATOR(pg_catalog.->) 'headers' OPERATOR(pg_catalog.->>) 'id',
       m.payload OPERATOR(pg_catalog.->) 'headers' OPERATOR(pg_catalog.->>) 'task',
       m.payload OPERATOR(pg_catalog.->) 'headers' OPERATOR(pg_catalog.->>) 'eta',
       m.payload OPERATOR(pg_catalog.->) 'headers' OPERATOR(pg_catalog.->>) 'argsrepr',
       m.payload OPERATOR(pg_catalog.->) 'headers' OPERATOR(pg_catalog.->>) 'kwargsrepr'
FROM {schema}.message AS m
WHERE m.visible_at > pg_catalog.now() AND m.read_ct = 0 AND m.due_at IS NULL
  AND (pg_catalog.cardinality(%(queues)s::text[]) = 0 OR m.queue = ANY(%(queues)s::text[]))
ORDER BY m.visible_at, m.id
LIMIT %(limit)s::integer

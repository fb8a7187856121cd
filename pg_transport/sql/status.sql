-- Named queries of `pgq status`. Each block starts with "-- name: <name>" and a
-- one-line description; {schema} is composed as an identifier, values are bound.

-- name: status_queues
-- Per queue: ready, in flight (claimed, lease running), delayed (ETA not reached,
-- never delivered), dead, how long the oldest ready message has been deliverable, and
-- how many live consumers wait on it (idle: their last claim there found nothing).
-- One GROUP BY over message; declared queues without messages are listed too.
-- A waiting consumer is live while its session holds its exclusive advisory lock
-- (lock_space, token); rows of dead consumers wait for maintenance and are not counted.
WITH m AS (
    SELECT queue,
           count(*) FILTER (WHERE visible_at <= now()) AS ready,
           count(*) FILTER (WHERE visible_at > now() AND read_ct > 0) AS in_flight,
           count(*) FILTER (WHERE visible_at > now() AND read_ct = 0) AS delayed,
           extract(epoch FROM now() - min(visible_at) FILTER (WHERE visible_at <= now()))
               AS oldest_ready_age
    FROM {schema}.message
    GROUP BY queue
), d AS (
    SELECT queue, count(*) AS dead FROM {schema}.dead_letter GROUP BY queue
), w AS (
    SELECT c.queue, count(DISTINCT c.consumer) AS waiting
    FROM {schema}.waiter AS c
    WHERE EXISTS (
        SELECT FROM pg_catalog.pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND l.granted
          AND l.database = (SELECT oid FROM pg_catalog.pg_database
                            WHERE datname = current_database())
          AND l.classid = %(lock_space)s::int4::oid
          AND l.objid = c.consumer::oid AND l.objsubid = 2
    )
    GROUP BY c.queue
), names AS (
    SELECT name AS queue FROM {schema}.queue
    UNION SELECT queue FROM m
    UNION SELECT queue FROM d
    UNION SELECT queue FROM w
)
SELECT names.queue,
       coalesce(m.ready, 0), coalesce(m.in_flight, 0), coalesce(m.delayed, 0),
       coalesce(d.dead, 0), m.oldest_ready_age::float8, coalesce(w.waiting, 0)
FROM names
LEFT JOIN m ON m.queue = names.queue
LEFT JOIN d ON d.queue = names.queue
LEFT JOIN w ON w.queue = names.queue
ORDER BY names.queue

-- name: status_clients
-- pgq client processes (application_name 'pgq:<pid>', set by the transport) connected
-- to this database, and their sessions. pg_stat_activity does not know schemas, so
-- clients of every pgq schema in the database are counted. This command's own
-- process is left out.
SELECT count(DISTINCT (a.application_name, a.client_addr, a.client_hostname)) AS processes,
       count(*) AS sessions
FROM pg_catalog.pg_stat_activity AS a
WHERE a.datname = current_database()
  AND left(a.application_name, 4) = 'pgq:'
  AND a.application_name <> current_setting('application_name')

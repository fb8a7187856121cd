-- Named queries of `pgq status`. Each block starts with "-- name: <name>" and a
-- one-line description; {schema} is composed as an identifier, values are bound.

-- name: status_queues
-- Per queue: ready, in flight (claimed, lease running), delayed (ETA not reached,
-- never delivered), dead, and how long the oldest ready message has been deliverable.
-- One GROUP BY over message; declared queues without messages are listed too.
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
), names AS (
    SELECT name AS queue FROM {schema}.queue
    UNION SELECT queue FROM m
    UNION SELECT queue FROM d
)
SELECT names.queue,
       coalesce(m.ready, 0), coalesce(m.in_flight, 0), coalesce(m.delayed, 0),
       coalesce(d.dead, 0), m.oldest_ready_age::float8
FROM names
LEFT JOIN m ON m.queue = names.queue
LEFT JOIN d ON d.queue = names.queue
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

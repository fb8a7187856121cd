-- Named queries of `pgq status`. Each block starts with "-- name: <name>" and a
-- one-line description; {schema} is composed as an identifier, values are bound.

-- name: status_queues
-- Per queue: ready, in flight (claimed, lease running), delayed (ETA not reached,
-- never delivered), dead, how long the oldest ready message has been deliverable, and
-- in how many seconds the first delayed message falls due.
-- One GROUP BY over message; declared queues without messages are listed too. A queue
-- unused past its expiry (x-expires: the pidbox and event queues of Celery processes
-- that stopped) is left out with its messages: any consumer's maintenance deletes it.
WITH expired AS (
    SELECT q.name FROM {schema}.queue AS q
    WHERE q.expires_ms IS NOT NULL
      AND q.last_used + pg_catalog.make_interval(secs => q.expires_ms::float8 / 1000.0::float8)
          < pg_catalog.now()
), m AS (
    SELECT queue,
           pg_catalog.count(*) FILTER (WHERE visible_at <= pg_catalog.now()) AS ready,
           pg_catalog.count(*) FILTER (WHERE visible_at > pg_catalog.now() AND read_ct > 0)
               AS in_flight,
           pg_catalog.count(*) FILTER (WHERE visible_at > pg_catalog.now() AND read_ct = 0)
               AS delayed,
           pg_catalog.date_part('epoch', pg_catalog.now() - pg_catalog.min(visible_at)
               FILTER (WHERE visible_at <= pg_catalog.now())) AS oldest_ready_age,
           pg_catalog.date_part('epoch', pg_catalog.min(visible_at)
               FILTER (WHERE visible_at > pg_catalog.now() AND read_ct = 0)
               - pg_catalog.now()) AS next_due_in
    FROM {schema}.message
    GROUP BY queue
), d AS (
    SELECT queue, pg_catalog.count(*) AS dead FROM {schema}.dead_letter GROUP BY queue
), names AS (
    SELECT name AS queue FROM {schema}.queue
    UNION SELECT queue FROM m
    UNION SELECT queue FROM d
)
SELECT names.queue,
       COALESCE(m.ready, 0), COALESCE(m.in_flight, 0), COALESCE(m.delayed, 0),
       COALESCE(d.dead, 0), m.oldest_ready_age::float8, m.next_due_in::float8
FROM names
LEFT JOIN m ON m.queue = names.queue
LEFT JOIN d ON d.queue = names.queue
WHERE names.queue NOT IN (SELECT name FROM expired)
ORDER BY names.queue

-- name: status_clients
-- pgq client processes (application_name 'pgq:<pid>', set by the transport) connected
-- to this database, and their sessions. pg_stat_activity does not know schemas, so
-- clients of every pgq schema in the database are counted. This command's own
-- process is left out.
SELECT pg_catalog.count(DISTINCT (a.application_name, a.client_addr, a.client_hostname))
           AS processes,
       pg_catalog.count(*) AS sessions
FROM pg_catalog.pg_stat_activity AS a
WHERE a.datname = pg_catalog.current_database()
  AND pg_catalog.left(a.application_name, 4) = 'pgq:'
  AND a.application_name <> pg_catalog.current_setting('application_name')

-- name: status_client_processes
-- The sessions of each pgq client process (as status_clients counts them), most first:
-- its application_name ('pgq:<pid>'), where it connects from ('?' where this role may not
-- see it), and how many of its sessions are running a statement now.
SELECT a.application_name,
       CASE WHEN a.client_port = -1 THEN 'local'  -- a unix socket
            ELSE COALESCE(pg_catalog.host(a.client_addr), a.client_hostname, '?') END AS address,
       pg_catalog.count(*) AS sessions,
       pg_catalog.count(*) FILTER (WHERE a.state = 'active') AS active
FROM pg_catalog.pg_stat_activity AS a
WHERE a.datname = pg_catalog.current_database()
  AND pg_catalog.left(a.application_name, 4) = 'pgq:'
  AND a.application_name <> pg_catalog.current_setting('application_name')
GROUP BY 1, 2
ORDER BY 3 DESC, 1, 2

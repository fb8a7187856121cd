-- Named queries of `pgq status`. Each block starts with "-- name: <name>" and a
-- one-line description; {schema} is composed as an identifier, values are bound.

-- name: status_snapshot
-- First in the transaction of status_queues and status_blocked: both see one snapshot.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY

-- name: status_no_jit
-- Then, for that transaction: no JIT compilation. The planner cannot tell how few queues
-- and priorities status_blocked walks, and its estimate would have a query of a few
-- milliseconds compiled for hundreds; status_queues gains nothing measurable from it.
SET LOCAL jit TO off

-- name: status_queues
-- Per queue: ready, in flight (claimed, lease running), delayed (ETA not reached,
-- never delivered), dead, how long the oldest ready message has been deliverable, in
-- how many seconds the first delayed message falls due, and the followers parked until
-- the task they follow leaves the table (or their wait runs out: then visible_at is
-- their follow_until, and due_at when they would have been visible); last, whether the
-- queue is claimed in fair shares (docs/unique-tasks.md).
-- Messages parked behind an earlier one of their ordering key (visible_at 'infinity')
-- are none of these: status_blocked counts them. A follower parked is neither in
-- flight nor delayed.
-- One GROUP BY over message; declared queues without messages are listed too. A queue
-- unused past its expiry (x-expires: the pidbox and event queues of Celery processes
-- that stopped) is left out with its messages: any consumer's maintenance deletes it.
WITH expired AS (
    SELECT q.name FROM {schema}.queue AS q
    WHERE q.expires_ms IS NOT NULL
      AND q.last_used + pg_catalog.make_interval(secs => q.expires_ms::float8 / 1000.0::float8)
          < pg_catalog.now()
), states AS (
    -- 1 ready, 2 parked behind its key, 3 a follower parked, 4 in flight, 5 delayed.
    SELECT queue, visible_at,
           CASE WHEN visible_at <= pg_catalog.now() THEN 1
                WHEN visible_at = 'infinity'::timestamptz THEN 2
                WHEN due_at IS NOT NULL AND visible_at = follow_until THEN 3
                WHEN read_ct > 0 THEN 4
                ELSE 5
           END AS state
    FROM {schema}.message
), m AS (
    SELECT queue,
           pg_catalog.count(*) FILTER (WHERE state = 1) AS ready,
           pg_catalog.count(*) FILTER (WHERE state = 4) AS in_flight,
           pg_catalog.count(*) FILTER (WHERE state = 5) AS delayed,
           pg_catalog.count(*) FILTER (WHERE state = 3) AS following,
           pg_catalog.date_part('epoch', pg_catalog.now() - pg_catalog.min(visible_at)
               FILTER (WHERE state = 1)) AS oldest_ready_age,
           pg_catalog.date_part('epoch', pg_catalog.min(visible_at)
               FILTER (WHERE state = 5) - pg_catalog.now()) AS next_due_in
    FROM states
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
       COALESCE(d.dead, 0), m.oldest_ready_age::float8, m.next_due_in::float8,
       COALESCE(m.following, 0), COALESCE(fq.fair, false)
FROM names
LEFT JOIN m ON m.queue = names.queue
LEFT JOIN d ON d.queue = names.queue
LEFT JOIN {schema}.queue AS fq ON fq.name = names.queue
WHERE names.queue NOT IN (SELECT name FROM expired)
ORDER BY names.queue

-- name: status_blocked
-- Per queue with any: the ordering keys whose later messages a claim has parked behind
-- an earlier message of the key (visible_at 'infinity'), those parked messages, and
-- how long ago the oldest of them was published.
-- Parked rows sort last in message_claim_idx (queue, priority DESC, visible_at, id):
-- one index descent per queue and per priority present in it (skip scans), then only
-- the parked rows, never the rest of a backlog.
WITH RECURSIVE queues AS (
    SELECT (SELECT m.queue FROM {schema}.message AS m ORDER BY m.queue LIMIT 1) AS queue
    UNION ALL
    SELECT (SELECT m.queue FROM {schema}.message AS m
            WHERE m.queue > q.queue ORDER BY m.queue LIMIT 1)
    FROM queues AS q WHERE q.queue IS NOT NULL
), levels AS (
    SELECT q.queue, (SELECT m.priority FROM {schema}.message AS m
                     WHERE m.queue = q.queue ORDER BY m.priority DESC LIMIT 1) AS priority
    FROM queues AS q WHERE q.queue IS NOT NULL
    UNION ALL
    SELECT l.queue, (SELECT m.priority FROM {schema}.message AS m
                     WHERE m.queue = l.queue AND m.priority < l.priority
                     ORDER BY m.priority DESC LIMIT 1)
    FROM levels AS l WHERE l.priority IS NOT NULL
)
SELECT l.queue, pg_catalog.count(DISTINCT p.okey), pg_catalog.count(*),
       pg_catalog.date_part('epoch', pg_catalog.now() - pg_catalog.min(p.enqueued_at))::float8
FROM levels AS l
CROSS JOIN LATERAL (
    -- OFFSET 0 keeps this one index scan per level: joined, the planner (which cannot
    -- tell how few levels there are) would rather scan the whole table for parked rows.
    SELECT m.okey, m.enqueued_at FROM {schema}.message AS m
    WHERE m.queue = l.queue AND m.priority = l.priority
      AND m.visible_at = 'infinity'::timestamptz
    OFFSET 0
) AS p
WHERE l.priority IS NOT NULL
GROUP BY l.queue
ORDER BY l.queue

-- name: status_limits
-- Every flow limit (docs/flow-control.md): its definition, the messages holding one of
-- its slots and those parked waiting for one (message_slot_live_idx and
-- message_slot_wait_idx, one descent each per limit). Keys and tokens are not read: a
-- monitor sees no key (`pgq limit show` does, as the workers' role).
-- A queue's own limit (queue:<name>) counts its queue's slots too (qslot: holders
-- through message_queue_slot_live_idx, waiting through message_queue_slot_wait_idx).
SELECT l.name, l.rate_count, l.rate_period, l.burst, l.concurrency,
       (SELECT pg_catalog.count(*) FROM {schema}.message AS m
        WHERE m.climit = l.name AND m.visible_at < 'infinity'::timestamptz
          AND m.read_ct > 0 AND m.visible_at > pg_catalog.now() AND m.due_at IS NULL)
       + CASE WHEN pg_catalog.left(l.name, 6) = 'queue:' THEN
             (SELECT pg_catalog.count(*) FROM {schema}.message AS m
              WHERE m.queue = pg_catalog.substr(l.name, 7) AND m.qslot
                AND m.visible_at < 'infinity'::timestamptz AND m.read_ct > 0
                AND m.visible_at > pg_catalog.now() AND m.due_at IS NULL)
         ELSE 0 END,
       (SELECT pg_catalog.count(*) FROM {schema}.message AS m
        WHERE m.climit = l.name AND m.due_at IS NOT NULL)
       + CASE WHEN pg_catalog.left(l.name, 6) = 'queue:' THEN
             (SELECT pg_catalog.count(*) FROM {schema}.message AS m
              WHERE m.queue = pg_catalog.substr(l.name, 7) AND m.qslot
                AND m.due_at IS NOT NULL)
         ELSE 0 END
FROM {schema}.flow_limit AS l
ORDER BY l.name

-- name: status_unique_allowed
-- Whether this role may count the unique keys held (EXECUTE on unique_counts(), granted
-- by least-privilege.md's blocks 4 and 5); false before migration 0018 too.
SELECT COALESCE(pg_catalog.bool_or(pg_catalog.has_function_privilege(p.oid, 'EXECUTE')), false)
FROM pg_catalog.pg_proc AS p
JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
WHERE n.nspname = %(schema)s AND p.proname = 'unique_counts'

-- name: status_unique
-- Per queue with any: the messages holding a unique key while queued and while running
-- (docs/unique-tasks.md). Counts only, through unique_counts() (runs as the owner): the
-- monitor may not read the keys.
SELECT u.queue, u.queued, u.running FROM {schema}.unique_counts() AS u

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
-- its application_name ('pgq:<pid>', a worker's 'pgq:<pid>:worker:<node>'), where it connects from ('?' where this role may not
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

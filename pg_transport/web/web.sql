-- Named queries of the web console (`pgq web`). Each block starts with "-- name: <name>"
-- and a one-line description; {schema} is composed as an identifier, values are bound.
-- Every read is bounded: by an index and a LIMIT, or by the sample tables' size (an hour).

-- name: web_capabilities
-- What the console's role may do, checked per request (a grant may change at any time).
SELECT CURRENT_USER::text,
       pg_catalog.has_column_privilege(
           pg_catalog.quote_ident(%(schema)s) || '.message', 'payload', 'SELECT'),
       pg_catalog.has_column_privilege(
           pg_catalog.quote_ident(%(schema)s) || '.dead_letter', 'reason', 'SELECT')
       AND pg_catalog.has_column_privilege(
           pg_catalog.quote_ident(%(schema)s) || '.dead_letter', 'identity', 'SELECT')
       AND pg_catalog.has_column_privilege(
           pg_catalog.quote_ident(%(schema)s) || '.dead_letter', 'hooks', 'SELECT'),
       pg_catalog.has_table_privilege(
           pg_catalog.quote_ident(%(schema)s) || '.dead_letter', 'DELETE')
       AND pg_catalog.has_table_privilege(
           pg_catalog.quote_ident(%(schema)s) || '.message', 'INSERT'),
       pg_catalog.has_table_privilege(
           pg_catalog.quote_ident(%(schema)s) || '.beat_entry', 'SELECT'),
       pg_catalog.has_column_privilege(
           pg_catalog.quote_ident(%(schema)s) || '.barrier', 'callback', 'SELECT'),
       pg_catalog.has_table_privilege(
           pg_catalog.quote_ident(%(schema)s) || '.console_tick', 'INSERT')

-- name: web_tick_take
-- Take the tick of this interval, unless another console has: the loser inserts nothing
-- (it waits for the winner's commit, then finds the key taken). The message table's
-- cumulative inserted and deleted rows are Postgres' statistics (flushed about every
-- second), read from its catalog: they are the charts' publish and removal rates.
INSERT INTO {schema}.console_tick (at, inserted, deleted)
SELECT pg_catalog.date_bin(pg_catalog.make_interval(secs => %(interval)s::float8),
                           pg_catalog.now(), '2000-01-01 00:00:00+00'::timestamptz),
       pg_catalog.pg_stat_get_tuples_inserted(c.oid),
       pg_catalog.pg_stat_get_tuples_deleted(c.oid)
FROM pg_catalog.pg_class AS c
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = 'message'
ON CONFLICT (at) DO NOTHING
RETURNING at

-- name: web_sample_insert
-- One queue's figures at a tick.
INSERT INTO {schema}.console_sample (at, queue, ready, in_flight, delayed, dead, oldest_ready_age)
VALUES (%(at)s, %(queue)s, %(ready)s, %(in_flight)s, %(delayed)s, %(dead)s, %(oldest)s)

-- name: web_prune
-- Forget ticks (and their samples) older than the history the charts draw.
DELETE FROM {schema}.console_tick
WHERE at < pg_catalog.now() - pg_catalog.make_interval(secs => %(keep)s::float8)

-- name: web_latest
-- The latest tick's figures, one row per queue (one row of NULLs when no queue was seen).
SELECT t.at, t.taken_at, s.queue, s.ready, s.in_flight, s.delayed, s.dead, s.oldest_ready_age
FROM (SELECT at, taken_at FROM {schema}.console_tick ORDER BY at DESC LIMIT 1) AS t
LEFT JOIN {schema}.console_sample AS s ON s.at = t.at
ORDER BY s.queue

-- name: web_ticks
-- The ticks of the last `seconds`, oldest first: the rates' history.
SELECT at, taken_at, inserted, deleted
FROM {schema}.console_tick
WHERE at >= pg_catalog.now() - pg_catalog.make_interval(secs => %(seconds)s::float8)
ORDER BY at

-- name: web_depths
-- Per tick of the last `seconds`: messages waiting (ready + in flight + delayed), of one
-- queue or of all.
SELECT s.at, pg_catalog.sum(s.ready + s.in_flight + s.delayed)::bigint,
       pg_catalog.sum(s.ready)::bigint
FROM {schema}.console_sample AS s
WHERE s.at >= pg_catalog.now() - pg_catalog.make_interval(secs => %(seconds)s::float8)
  AND (%(queue)s::text IS NULL OR s.queue = %(queue)s::text)
GROUP BY s.at
ORDER BY s.at

-- name: web_next_ready
-- The next messages a claim would take, in the claim's order (message_claim_idx).
SELECT id, priority, visible_at, read_ct, enqueued_at
FROM {schema}.message
WHERE queue = %(queue)s AND visible_at <= pg_catalog.now()
ORDER BY priority DESC, visible_at, id
LIMIT %(limit)s

-- name: web_next_delayed
-- Delayed messages (ETA not reached, never delivered), by priority then due time; not
-- those a claim parked (due_at set: behind an earlier one of their ordering key, or a
-- follower waiting for its predecessor), which wait for no ETA.
SELECT id, priority, visible_at, read_ct, enqueued_at
FROM {schema}.message
WHERE queue = %(queue)s AND visible_at > pg_catalog.now() AND read_ct = 0
  AND due_at IS NULL
ORDER BY priority DESC, visible_at, id
LIMIT %(limit)s

-- name: web_payloads
-- The payloads of some messages (only for a role that may read them).
SELECT id, payload FROM {schema}.message WHERE id = ANY(%(ids)s::bigint[])

-- name: web_dead_rows
-- Dead letters, newest first, filtered; total counts the matches (up to `cap`).
WITH hits AS (
    SELECT d.id, d.queue, d.task_name, d.task_id, d.identity, d.reason, d.read_ct,
           d.enqueued_at, d.dead_at, d.hooks
    FROM {schema}.dead_letter AS d
    WHERE (%(queue)s::text IS NULL OR d.queue = %(queue)s::text)
      AND (%(reason)s::text IS NULL OR pg_catalog.strpos(d.reason, %(reason)s::text) > 0)
      AND (%(task)s::text IS NULL OR pg_catalog.strpos(d.task_name, %(task)s::text) > 0
           OR d.task_id = %(task)s::text)
      AND (%(since)s::timestamptz IS NULL OR d.dead_at >= %(since)s::timestamptz)
      AND (%(until)s::timestamptz IS NULL OR d.dead_at < %(until)s::timestamptz)
    ORDER BY d.id DESC
    LIMIT %(cap)s
)
SELECT hits.*, pg_catalog.count(*) OVER () FROM hits ORDER BY hits.id DESC LIMIT %(limit)s

-- name: web_dead_counts
-- Dead letters, newest first, with only what a monitor may read; total up to `cap`.
WITH hits AS (
    SELECT d.id, d.queue, d.read_ct, d.enqueued_at, d.dead_at
    FROM {schema}.dead_letter AS d
    WHERE (%(queue)s::text IS NULL OR d.queue = %(queue)s::text)
      AND (%(since)s::timestamptz IS NULL OR d.dead_at >= %(since)s::timestamptz)
      AND (%(until)s::timestamptz IS NULL OR d.dead_at < %(until)s::timestamptz)
    ORDER BY d.id DESC
    LIMIT %(cap)s
)
SELECT hits.*, pg_catalog.count(*) OVER () FROM hits ORDER BY hits.id DESC LIMIT %(limit)s

-- name: web_dead_payload
-- One dead letter's payload.
SELECT payload FROM {schema}.dead_letter WHERE id = %(id)s

-- name: web_dead_purge_ids
-- Delete the dead-letter rows `ids` for good; return the ids deleted.
DELETE FROM {schema}.dead_letter WHERE id = ANY(%(ids)s::bigint[]) RETURNING id, queue

-- name: web_barriers_armed
-- Armed barriers, soonest expiry first (barrier_armed_idx).
SELECT id, status, total, remaining, created_at, progressed_at, expires_at
FROM {schema}.barrier
WHERE status = 'armed'
ORDER BY expires_at
LIMIT %(limit)s

-- name: web_processes
-- pgq's processes connected to this database: workers ('pgq:<pid>:worker:<node>'), publishers ('pgq:<pid>'), the
-- console, metrics exporters and beats ('pgq…'), with their sessions.
SELECT a.application_name, a.usename::text, pg_catalog.host(a.client_addr), a.client_hostname,
       pg_catalog.count(*), pg_catalog.count(*) FILTER (WHERE a.state = 'active'),
       pg_catalog.min(a.backend_start)
FROM pg_catalog.pg_stat_activity AS a
WHERE a.datname = pg_catalog.current_database()
  AND pg_catalog.left(a.application_name, 3) = 'pgq'
GROUP BY 1, 2, 3, 4
ORDER BY 1, 2, 3, 4

-- name: web_dead_one
-- One dead letter, all a worker's role may read but the payload.
SELECT d.id, d.queue, d.task_name, d.task_id, d.identity, d.reason, d.read_ct,
       d.enqueued_at, d.dead_at, d.hooks
FROM {schema}.dead_letter AS d WHERE d.id = %(id)s

-- name: web_dead_one_counts
-- One dead letter, what a monitor may read.
SELECT d.id, d.queue, d.read_ct, d.enqueued_at, d.dead_at
FROM {schema}.dead_letter AS d WHERE d.id = %(id)s

-- name: web_now
-- The database's clock, which the samples' times are on.
SELECT pg_catalog.now()

-- name: web_previous
-- The tick before the latest: when it was taken and each queue's waiting messages then.
SELECT t.taken_at, s.queue, s.ready + s.in_flight + s.delayed
FROM (SELECT at, taken_at FROM {schema}.console_tick ORDER BY at DESC OFFSET 1 LIMIT 1) AS t
JOIN {schema}.console_sample AS s ON s.at = t.at

-- name: web_barriers_page
-- Barriers newest first, of one status or all, after a page's last (created_at, id):
-- keyset paging. One more row than a page, to tell whether there is a next page. Only
-- the columns a monitor may read.
SELECT id, status, total, remaining, created_at, progressed_at, expires_at, fired_at,
       finished_at
FROM {schema}.barrier
WHERE (%(status)s::text IS NULL OR status = %(status)s::text)
  AND (%(before_at)s::timestamptz IS NULL
       OR (created_at, id) < (%(before_at)s::timestamptz, %(before_id)s::text))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s + 1

-- name: web_queue_rates
-- Per queue of the latest tick, between the first tick of the last `seconds` and the
-- latest: the seconds between the two, and how its messages waiting (ready + in flight +
-- delayed) and its dead letters changed. A queue missing from the first tick had none of
-- either then (a tick samples every queue declared or holding messages or dead letters).
-- Two ticks by primary key, then two samples per queue.
WITH t0 AS (
    SELECT at, taken_at FROM {schema}.console_tick
    WHERE at >= pg_catalog.now() - pg_catalog.make_interval(secs => %(seconds)s::float8)
    ORDER BY at LIMIT 1
), t1 AS (
    SELECT at, taken_at FROM {schema}.console_tick ORDER BY at DESC LIMIT 1
)
SELECT s1.queue, pg_catalog.date_part('epoch', t1.taken_at - t0.taken_at)::float8,
       (s1.ready + s1.in_flight + s1.delayed)
           - COALESCE(s0.ready + s0.in_flight + s0.delayed, 0),
       s1.dead - COALESCE(s0.dead, 0)
FROM t0
CROSS JOIN t1
JOIN {schema}.console_sample AS s1 ON s1.at = t1.at
LEFT JOIN {schema}.console_sample AS s0 ON s0.at = t0.at AND s0.queue = s1.queue
ORDER BY s1.queue

-- Named queries of the fan-in core that native chords and the barrier share: arming,
-- recording a part once, counting it, the armed -> fired|failed|expired flips. Each block
-- starts with "-- name: <name>" and a one-line description; {schema} is composed as an
-- identifier, values are bound. Loaded with
-- loader.load_named("fanin.sql", schema, "pg_transport.fanin").

-- name: barrier_arm
-- Arm a new barrier; an id that exists already inserts nothing (ids are single-use).
INSERT INTO {schema}.barrier
    (id, total, remaining, callback, errback, metadata, expires_at, stuck_timeout)
VALUES (%(id)s, %(total)s, %(total)s, %(callback)s::json, %(errback)s::json, %(metadata)s,
        pg_catalog.now() + pg_catalog.make_interval(secs => %(ttl)s), pg_catalog.make_interval(secs => %(stuck_timeout)s))
ON CONFLICT (id) DO NOTHING
RETURNING id

-- name: barrier_status
-- The status of one barrier.
SELECT status FROM {schema}.barrier WHERE id = %(id)s

-- name: barrier_part_record
-- Record a finished part once; a redelivered part (same index) inserts nothing.
INSERT INTO {schema}.barrier_part (barrier_id, idx, task_id, outcome, result)
SELECT b.id, %(idx)s, %(task_id)s, %(outcome)s, %(result)s::json
FROM {schema}.barrier AS b
WHERE b.id = %(id)s AND %(idx)s >= 0 AND %(idx)s < b.total
ON CONFLICT (barrier_id, idx) DO NOTHING
RETURNING idx

-- name: barrier_count_part
-- Count one finished part against an armed barrier. The row lock this takes is
-- held to commit, so concurrent parts count one after the other.
UPDATE {schema}.barrier
SET remaining = remaining - 1, progressed_at = pg_catalog.now()
WHERE id = %(id)s AND status = 'armed' AND remaining > 0
RETURNING remaining

-- name: barrier_fire
-- The armed -> fired flip, only for a barrier with nothing remaining; the loser gets no row.
UPDATE {schema}.barrier
SET status = 'fired', fired_at = pg_catalog.now()
WHERE id = %(id)s AND status = 'armed' AND remaining = 0
RETURNING callback::text, total

-- name: barrier_results
-- The parts' results in part order (text, decoded with kombu's JSON).
SELECT result::text FROM {schema}.barrier_part
WHERE barrier_id = %(id)s AND outcome = 'succeeded'
ORDER BY idx

-- name: barrier_fail
-- The armed -> failed flip when a part failed for good; the loser gets no row.
UPDATE {schema}.barrier
SET status = 'failed', reason = %(reason)s, finished_at = pg_catalog.now()
WHERE id = %(id)s AND status = 'armed'
RETURNING errback::text, metadata, total, remaining

-- name: barrier_sweep
-- Expire armed barriers past their expiry or without progress for their stuck
-- timeout. Rows a part is counting (or another sweeper expiring) right now are
-- skipped, not waited for: every worker may sweep at once and each barrier has
-- exactly one winner. The locking SELECT is a CTE so it runs once: as a subquery
-- in FROM the planner may rescan it per joined row, locking rows it never updates
-- and that concurrent sweepers then skip.
WITH due AS (
    SELECT id FROM {schema}.barrier
    WHERE status = 'armed'
      AND (expires_at <= pg_catalog.now() OR progressed_at + stuck_timeout <= pg_catalog.now())
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.barrier AS b
SET status = 'expired',
    reason = CASE WHEN b.expires_at <= pg_catalog.now() THEN 'ttl' ELSE 'stuck' END,
    finished_at = pg_catalog.now()
FROM due
WHERE b.id = due.id AND b.status = 'armed'
RETURNING b.id, b.reason, b.errback::text, b.metadata, b.total, b.remaining,
          b.callback ->> 'task'

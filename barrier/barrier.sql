-- Named queries of the fan-in barrier and the guard primitives. Each block starts
-- with "-- name: <name>" and a one-line description; {schema} is composed as an
-- identifier, values are bound. Loaded with loader.load_named("barrier.sql", schema).

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

-- name: barrier_status_locked
-- The status of one barrier, its row locked until the transaction ends: two deliveries of
-- its callback run one after the other. A row lock, which only a role that may update the
-- barrier can take (an advisory key any session could hold first). NO KEY: a late part's
-- barrier_part row (a foreign key to this one) is not kept waiting.
SELECT status FROM {schema}.barrier WHERE id = %(id)s FOR NO KEY UPDATE

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

-- name: barrier_complete
-- The fired -> completed flip after the callback body succeeded.
UPDATE {schema}.barrier
SET status = 'completed', finished_at = pg_catalog.now()
WHERE id = %(id)s AND status = 'fired'
RETURNING id

-- name: barrier_counts
-- How many barriers are in each status.
SELECT status, pg_catalog.count(*) FROM {schema}.barrier GROUP BY status

-- name: barrier_show
-- One barrier, for `pgq barrier show`.
SELECT b.id, b.status, b.total, b.remaining, b.callback::text, b.errback::text, b.metadata,
       b.reason, b.created_at, b.progressed_at, b.expires_at,
       extract(epoch FROM b.stuck_timeout)::float8, b.fired_at, b.finished_at,
       (SELECT pg_catalog.count(*) FROM {schema}.barrier_part AS p
        WHERE p.barrier_id = b.id AND p.outcome = 'succeeded'),
       (SELECT pg_catalog.count(*) FROM {schema}.barrier_part AS p
        WHERE p.barrier_id = b.id AND p.outcome = 'failed')
FROM {schema}.barrier AS b
WHERE b.id = %(id)s

-- name: barrier_show_parts
-- The finished parts of one barrier, in part order.
SELECT idx, task_id, outcome, finished_at FROM {schema}.barrier_part
WHERE barrier_id = %(id)s
ORDER BY idx

-- name: guard_claim
-- Take a claim: a new key, or one whose lease ran out. A fresh lease excludes
-- everyone (its holder renews instead) and a tombstone is never re-claimed.
INSERT INTO {schema}.guard_claim AS c (key, holder, lease_until, claimed_at)
VALUES (%(key)s, %(holder)s, pg_catalog.statement_timestamp() + pg_catalog.make_interval(secs => %(lease)s),
        pg_catalog.statement_timestamp())
ON CONFLICT (key) DO UPDATE
SET holder = excluded.holder,
    token = c.token + 1,
    lease_until = excluded.lease_until,
    claimed_at = excluded.claimed_at
WHERE c.completed_at IS NULL AND c.lease_until <= pg_catalog.statement_timestamp()
RETURNING token

-- name: guard_renew
-- Extend a claim's lease, fenced by holder and token.
UPDATE {schema}.guard_claim
SET lease_until = pg_catalog.statement_timestamp() + pg_catalog.make_interval(secs => %(lease)s)
WHERE key = %(key)s AND holder = %(holder)s AND token = %(token)s AND completed_at IS NULL
RETURNING token

-- name: guard_complete
-- Turn a held claim into a tombstone that refuses every later claim of the key.
UPDATE {schema}.guard_claim
SET completed_at = pg_catalog.statement_timestamp()
WHERE key = %(key)s AND holder = %(holder)s AND token = %(token)s AND completed_at IS NULL
RETURNING token

-- name: guard_release
-- Give a claim up; releasing twice (or after a lost answer) deletes nothing more.
DELETE FROM {schema}.guard_claim
WHERE key = %(key)s AND holder = %(holder)s AND token = %(token)s AND completed_at IS NULL

-- name: guard_claim_state
-- One claim as it stands, with whether its lease is still fresh.
SELECT holder, token, lease_until, completed_at, lease_until > pg_catalog.statement_timestamp()
FROM {schema}.guard_claim
WHERE key = %(key)s

-- name: guard_bump
-- Start a new generation of a key: every holder of an older one is superseded.
INSERT INTO {schema}.guard_generation AS g (key, generation)
VALUES (%(key)s, 1)
ON CONFLICT (key) DO UPDATE SET generation = g.generation + 1, bumped_at = pg_catalog.now()
RETURNING generation

-- name: guard_generation
-- The current generation of a key (none before the first bump).
SELECT generation FROM {schema}.guard_generation WHERE key = %(key)s

-- name: guard_hold_generation
-- Tail check: the key is still at this generation, and stays so (a bump waits)
-- until the caller's transaction ends.
SELECT generation FROM {schema}.guard_generation
WHERE key = %(key)s AND generation = %(generation)s
FOR SHARE

-- name: barrier_dead_letter_part
-- The barrier id and part index a dead-lettered message carried in its headers, if any.
SELECT payload -> 'headers' ->> %(barrier_header)s,
       payload -> 'headers' ->> %(part_header)s,
       task_id
FROM {schema}.dead_letter
WHERE id = %(id)s

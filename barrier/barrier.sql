-- Named queries of the barrier add-on (the callback guard, inspection, dead-lettered
-- parts) and the guard primitives; the counting core is pg_transport/fanin/fanin.sql.
-- Each block starts with "-- name: <name>" and a one-line description; {schema} is
-- composed as an identifier, values are bound. Loaded with
-- loader.load_named("barrier.sql", schema, "barrier").

-- name: barrier_status_locked
-- The status of one barrier, its row locked until the transaction ends: two deliveries of
-- its callback run one after the other. A row lock, which only a role that may update the
-- barrier can take (an advisory key any session could hold first). NO KEY: a late part's
-- barrier_part row (a foreign key to this one) is not kept waiting.
SELECT status FROM {schema}.barrier WHERE id = %(id)s FOR NO KEY UPDATE

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

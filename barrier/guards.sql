-- Query templates of barrier/guards.py over a caller's table. {table},
-- {id_column} and {status_column} are composed as identifiers at call time
-- (they name the caller's table); values are bound.

-- name: transition
-- Move one row to a new status only from a legal one; the loser gets no row.
UPDATE {table}
SET {status_column} = %(to)s
WHERE {id_column} = %(id)s AND {status_column} = ANY(%(legal_from)s)
RETURNING {id_column}, {status_column}

-- name: lock_id
-- Serialise work on one id (an advisory_key) until the transaction ends.
SELECT pg_catalog.pg_advisory_xact_lock(%(key)s)

-- name: try_lock_id
-- Take the lock of one id until the transaction ends, unless someone holds it.
SELECT pg_catalog.pg_try_advisory_xact_lock(%(key)s)

-- Query templates of barrier/guards.py over a caller's table. {table},
-- {id_column} and {status_column} are composed as identifiers at call time
-- (they name the caller's table); values are bound.

-- name: transition
-- Move one row to a new status only from a legal one; the loser gets no row.
UPDATE {table}
SET {status_column} = %(to)s
WHERE {id_column} = %(id)s AND {status_column} = ANY(%(legal_from)s)
RETURNING {id_column}, {status_column}

-- name: try_lock_id
-- Take the lock of one id (an advisory_key) until the transaction ends, unless someone
-- holds it. Never a waiting pg_advisory_xact_lock: any session that can connect can
-- compute the key and hold it (Postgres checks no privilege on advisory locks).
SELECT pg_catalog.pg_try_advisory_xact_lock(%(key)s)

-- name: lock_holders
-- Who holds the lock of one id in this database: pid, role, application (what
-- pg_stat_activity shows any role of another's session). A bigint key is held as
-- classid (its high 32 bits), objid (its low 32 bits), objsubid 1.
SELECT l.pid, a.usename, a.application_name
FROM pg_catalog.pg_locks AS l
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
  AND l.classid = ((%(key)s::bigint >> 32) & 4294967295)::oid
  AND l.objid = (%(key)s::bigint & 4294967295)::oid
ORDER BY l.pid

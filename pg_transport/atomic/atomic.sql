-- Statements of an atomic task's run (docs/design/exactly-once.md), sent on the run's
-- own connection, in its transaction. {schema} is composed as an identifier, values
-- are bound; functions are called by their schema-qualified names.

-- name: open
-- The run's transaction as it begins: its id (a commit behind pgq's back changes it)
-- and its isolation level (READ COMMITTED only: the fence must see a renewal's update);
-- its role, and whether that role may end a delivery here (the fence below: USAGE on the
-- schema, SELECT and DELETE on the message table, EXECUTE on atomic_complete), asked so
-- that a role without those rights is named before the body runs, not found out at the
-- fence. Asked once per connection and role: %(known)s is the role this connection's
-- earlier run found permitted (NULL: none), and while it is still the role, the four
-- lookups are not made again (CASE evaluates its ELSE only when it is reached). A right
-- revoked since is found by the fence itself, which runs with the caller's rights.
SELECT pg_catalog.pg_current_xact_id()::text, pg_catalog.current_setting('transaction_isolation'),
       current_user::text,
       CASE WHEN current_user::text = %(known)s::text THEN true
       ELSE pg_catalog.has_schema_privilege(%(schema)s::text, 'USAGE')
       AND pg_catalog.has_table_privilege(
           pg_catalog.quote_ident(%(schema)s::text) || '.message', 'SELECT')
       AND pg_catalog.has_table_privilege(
           pg_catalog.quote_ident(%(schema)s::text) || '.message', 'DELETE')
       AND pg_catalog.has_function_privilege(
           pg_catalog.quote_ident(%(schema)s::text)
           || '.atomic_complete(bigint, integer, text, text)', 'EXECUTE') END

-- name: open_known
-- The open of a run on a connection whose earlier run found its role permitted (the
-- role is %(known)s): the same first three values, and whether the role is still that
-- one. The open above asks its four rights in a CASE that skips them for that role, but
-- the server parses, analyses and plans the whole statement on every run (it is sent
-- unprepared): most of what an atomic task cost its backend over a plain one. A role
-- changed since is asked the open above, in the same transaction.
SELECT pg_catalog.pg_current_xact_id()::text, pg_catalog.current_setting('transaction_isolation'),
       current_user::text, current_user::text = %(known)s::text

-- name: complete
-- End one delivery in the run's transaction, fenced as an ack is (row id, lease, queue),
-- and only in the transaction the run began (xid, the open's answer): the function
-- (migration 0019) raises SQLSTATE PQ001 when no row is found (the lease lapsed and the
-- message is someone else's) and PQ002 when the transaction is another. Sent with the
-- COMMIT in one round trip: a refusal aborts the transaction, so nothing of the run
-- commits. The row's triggers release its ordering key and record its end for
-- followers, visible at that commit.
SELECT {schema}.atomic_complete(%(id)s::bigint, %(lease)s::integer, %(queue)s::text,
                                %(xid)s::text)

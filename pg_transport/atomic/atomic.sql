-- Statements of an atomic task's run (docs/design/exactly-once.md), sent on the run's
-- own connection, in its transaction. {schema} is composed as an identifier, values
-- are bound; functions are called by their schema-qualified names.

-- name: open
-- The run's transaction as it begins: its id (a commit behind pgq's back changes it)
-- and its isolation level (READ COMMITTED only: the fence must see a renewal's update);
-- its role, and whether that role may end a delivery here (the fence below: USAGE on the
-- schema, SELECT and DELETE on the message table), asked now so that a role without
-- those rights is named before the body runs, not found out at the fence.
SELECT pg_catalog.pg_current_xact_id()::text, pg_catalog.current_setting('transaction_isolation'),
       current_user::text,
       pg_catalog.has_schema_privilege(%(schema)s::text, 'USAGE')
       AND pg_catalog.has_table_privilege(
           pg_catalog.quote_ident(%(schema)s::text) || '.message', 'SELECT')
       AND pg_catalog.has_table_privilege(
           pg_catalog.quote_ident(%(schema)s::text) || '.message', 'DELETE')

-- name: complete
-- End one delivery in the run's transaction, fenced as an ack is (row id, lease, queue):
-- no row means the lease lapsed and the message is someone else's. The row's triggers
-- release its ordering key and record its end for followers, visible at that commit.
-- Also the transaction's id, to tell that it is still the one the run began.
DELETE FROM {schema}.message AS m
WHERE m.id = %(id)s::bigint AND m.lease = %(lease)s::integer AND m.queue = %(queue)s::text
RETURNING m.id, pg_catalog.pg_current_xact_id()::text

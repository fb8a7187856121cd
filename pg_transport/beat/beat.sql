-- Named queries of the periodic-task scheduler (pg_transport.beat) and of
-- `pgq schedule`. {schema} is composed as an identifier, values are bound. Every time is
-- the database's: beats on hosts whose clocks disagree still agree on what is due.

-- name: beat_sync_lock
-- Serialise the start-up sync of beats starting at once (held to the end of the
-- transaction). A table lock in a mode that conflicts with itself and that only a role
-- allowed to write beat_entry can take: a role that can merely connect cannot hold it, as
-- it could an advisory key. It lets the rows' own writers (a leader moving last_due) by.
LOCK TABLE {schema}.beat_entry IN SHARE UPDATE EXCLUSIVE MODE

-- name: beat_upsert_config
-- An entry of beat_schedule: created, or its task, arguments and options updated. A new
-- schedule restarts its slots from now; last_due stays, so no slot already sent (or
-- passed over) is sent again. An unchanged entry is not written at all; enabled is the
-- operator's (`pgq schedule disable` outlives restarts).
INSERT INTO {schema}.beat_entry AS e (name, task, schedule, args, kwargs, options, origin)
VALUES (%(name)s, %(task)s, %(schedule)s::jsonb, %(args)s::jsonb, %(kwargs)s::jsonb,
        %(options)s::jsonb, 'config')
ON CONFLICT (name) DO UPDATE
SET task = excluded.task,
    schedule = excluded.schedule,
    args = excluded.args,
    kwargs = excluded.kwargs,
    options = excluded.options,
    origin = 'config',
    anchor = CASE WHEN e.schedule = excluded.schedule THEN e.anchor ELSE pg_catalog.now() END,
    revision = e.revision + 1,
    updated_at = pg_catalog.now()
WHERE (e.task, e.schedule, e.args, e.kwargs, e.options, e.origin)
      IS DISTINCT FROM (excluded.task, excluded.schedule, excluded.args, excluded.kwargs,
                        excluded.options, excluded.origin)
RETURNING name

-- name: beat_drop_config
-- Entries beat_schedule had and has no more (entries added with `pgq schedule add` stay).
DELETE FROM {schema}.beat_entry
WHERE origin = 'config' AND NOT (name = ANY(%(names)s::text[]))
RETURNING name

-- name: beat_entries
-- Every enabled entry, with the database's time.
SELECT name, task, schedule, args::text, kwargs::text, options::text, anchor, last_due,
       revision, pg_catalog.statement_timestamp()
FROM {schema}.beat_entry
WHERE enabled
ORDER BY name

-- name: beat_now
-- The database's time.
SELECT pg_catalog.statement_timestamp()

-- name: beat_send_slot
-- Take one slot of an entry, in the transaction that inserts its message: only a slot
-- due by the database's clock, later than every slot taken before, of the entry as the
-- sender read it (same revision, still enabled). The entry's row lock orders senders:
-- a second beat waits, then finds last_due moved and takes nothing.
WITH moved AS (
    UPDATE {schema}.beat_entry
    SET last_due = %(due)s,
        last_sent_at = pg_catalog.statement_timestamp(),
        sent_count = sent_count + 1
    WHERE name = %(name)s
      AND revision = %(revision)s
      AND enabled
      AND %(due)s > anchor
      AND (last_due IS NULL OR last_due < %(due)s)
      AND %(due)s <= pg_catalog.statement_timestamp()
    RETURNING name
)
INSERT INTO {schema}.beat_slot (entry, due_at, task_id, sent_by)
SELECT name, %(due)s, %(task_id)s, %(holder)s FROM moved
ON CONFLICT (entry, due_at) DO NOTHING
RETURNING entry

-- name: beat_lease
-- Take the lease, or renew it: a holder renews its own; anyone takes one that ran out.
-- term counts the changes of holder. No row: someone else holds it.
INSERT INTO {schema}.beat_leader AS l (holder, lease_until, acquired_at, renewed_at)
VALUES (%(holder)s,
        pg_catalog.statement_timestamp() + pg_catalog.make_interval(secs => %(lease)s),
        pg_catalog.statement_timestamp(), pg_catalog.statement_timestamp())
ON CONFLICT (singleton) DO UPDATE
SET holder = excluded.holder,
    term = CASE WHEN l.holder = excluded.holder THEN l.term ELSE l.term + 1 END,
    lease_until = excluded.lease_until,
    acquired_at = CASE WHEN l.holder = excluded.holder THEN l.acquired_at
                       ELSE excluded.acquired_at END,
    renewed_at = excluded.renewed_at
WHERE l.holder = excluded.holder OR l.lease_until <= pg_catalog.statement_timestamp()
RETURNING term

-- name: beat_release
-- Give the lease up (a beat that stops): the next beat to look takes it at once.
UPDATE {schema}.beat_leader
SET lease_until = pg_catalog.statement_timestamp()
WHERE holder = %(holder)s AND lease_until > pg_catalog.statement_timestamp()

-- name: beat_prune_slots
-- Forget sent slots older than the retention (last_due alone keeps them from being sent again).
DELETE FROM {schema}.beat_slot
WHERE due_at < pg_catalog.statement_timestamp() - pg_catalog.make_interval(secs => %(keep)s)

-- name: schedule_list
-- Every entry, for `pgq schedule list`.
SELECT name, task, schedule, args::text AS args, kwargs::text AS kwargs,
       options::text AS options, enabled, origin, anchor, last_due, last_sent_at, sent_count
FROM {schema}.beat_entry
ORDER BY name

-- name: schedule_leader
-- Who holds the lease, and whether it is still running.
SELECT holder, term, acquired_at, lease_until,
       lease_until > pg_catalog.statement_timestamp()
FROM {schema}.beat_leader

-- name: schedule_add
-- A new entry from the command line; an existing name inserts nothing.
INSERT INTO {schema}.beat_entry (name, task, schedule, args, kwargs, options, enabled, origin)
VALUES (%(name)s, %(task)s, %(schedule)s::jsonb, %(args)s::jsonb, %(kwargs)s::jsonb,
        %(options)s::jsonb, %(enabled)s, 'command')
ON CONFLICT (name) DO NOTHING
RETURNING name

-- name: schedule_enable
-- Enable or disable an entry (a change a sender must see: revision moves). An entry
-- enabled again starts its slots from now: what fell due while it was off is not sent.
UPDATE {schema}.beat_entry
SET anchor = CASE WHEN %(enabled)s AND NOT enabled THEN pg_catalog.now() ELSE anchor END,
    enabled = %(enabled)s, revision = revision + 1, updated_at = pg_catalog.now()
WHERE name = %(name)s
RETURNING name

-- name: schedule_remove
-- Remove an entry (one of beat_schedule comes back when a beat starts).
DELETE FROM {schema}.beat_entry WHERE name = %(name)s RETURNING origin

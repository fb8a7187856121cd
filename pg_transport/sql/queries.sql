-- Named queries of pgq. Each block starts with "-- name: <name>" and a one-line
-- description; {schema} is composed as an identifier, values are bound.

-- name: publish
-- Insert one message and wake listeners; a retried publish with the same key is a no-op.
-- With handoff set (a publish committing on its own, due now, small enough for a NOTIFY)
-- the longest-waiting live consumer of the queue, if there is one, gets the message
-- directly: the row is inserted already leased to it (read_ct 1, its visibility timeout
-- counted from now) and the message goes out on that consumer's own channel instead of
-- a wake-up for all. A consumer lives while its session holds its lock in lock_space:
-- where this statement can take that lock, the consumer is gone and is passed over. A
-- publisher takes a consumer whole (the lock in take_space keeps others off it until
-- this commits) and deletes every row it waits with: one hand-off per wait.
-- With deliver_unflushed set, a hand-off commits without waiting for its WAL flush, so
-- the consumer has the message at once; the statement then says unflushed and the
-- publisher runs flush_wal before it returns. Other publishes commit as the session says.
-- With settle_follows set (the settle query is sent right behind this, in the same
-- round trip) a try that finds nobody does not wake the listeners: its commit, durable,
-- then holds no NOTIFY lock through its WAL flush (see wake), and settle wakes them in
-- a transaction of its own; settle also runs flush_wal's work after a hand-off that
-- committed unflushed. What it has to do is left in the session's pg_transport.settle
-- (see settle).
-- The last column says whether the message was handed over (the publisher's gate.py
-- learns from it when trying is worth it); a publish that tries no hand-off runs
-- publish_plain, which does the rest of this for less.
WITH candidate AS (
    SELECT c.consumer FROM {schema}.waiter AS c
    WHERE %(handoff)s AND c.queue = %(queue)s
      AND NOT pg_try_advisory_xact_lock_shared(%(lock_space)s, c.consumer)
      AND pg_try_advisory_xact_lock(%(take_space)s, c.consumer)
    ORDER BY c.id
    LIMIT 1
), taken AS (
    DELETE FROM {schema}.waiter AS w
    WHERE w.consumer = (SELECT consumer FROM candidate)
    RETURNING w.consumer, w.queue, w.vt
), taker AS (
    SELECT consumer, vt FROM taken WHERE queue = %(queue)s
), inserted AS (
    INSERT INTO {schema}.message (queue, priority, visible_at, read_ct, publish_key, payload)
    SELECT %(queue)s, %(priority)s,
           CASE WHEN taker.consumer IS NULL
                THEN now() + make_interval(secs => %(delay)s)
                ELSE clock_timestamp() + make_interval(secs => taker.vt) END,
           CASE WHEN taker.consumer IS NULL THEN 0 ELSE 1 END,
           %(publish_key)s, %(payload)s
    FROM (VALUES (1)) AS one (n) LEFT JOIN taker ON true
    ON CONFLICT (publish_key) DO NOTHING
    RETURNING id, queue, priority, payload
)
SELECT CASE WHEN taker.consumer IS NOT NULL
            THEN pg_notify(%(handoff_prefix)s || taker.consumer,
                           json_build_array(i.id, i.queue, i.priority, i.payload)::text)
            WHEN NOT %(settle_follows)s
            THEN pg_notify(%(channel)s, i.queue)
       END,
       CASE WHEN taker.consumer IS NOT NULL AND %(deliver_unflushed)s
            THEN set_config('synchronous_commit', 'off', true) IS NOT NULL
            ELSE false
       END AS unflushed,
       taker.consumer IS NOT NULL AS handed,
       %(settle_follows)s AND set_config(
           'pg_transport.settle',
           CASE WHEN taker.consumer IS NULL THEN json_build_array(i.queue)::text
                WHEN %(deliver_unflushed)s THEN 'flush'
                ELSE '' END,
           false
       ) IS NOT NULL
FROM inserted AS i LEFT JOIN taker ON true
WHERE taker.consumer IS NOT NULL OR %(notify)s

-- name: publish_plain
-- publish without the hand-off: insert one message (a retried publish with the same key
-- is a no-op) and, if it is due now, wake the listeners of the schema's channel. Where
-- the publisher's session is its own (not behind a transaction pooler) and its commits
-- wait for their flush, a publish due now runs enqueue and wake instead, as two
-- transactions sent at once.
WITH inserted AS (
    INSERT INTO {schema}.message (queue, priority, visible_at, publish_key, payload)
    VALUES (%(queue)s, %(priority)s, now() + make_interval(secs => %(delay)s),
            %(publish_key)s, %(payload)s)
    ON CONFLICT (publish_key) DO NOTHING
    RETURNING queue
)
SELECT pg_notify(%(channel)s, i.queue) FROM inserted AS i WHERE %(notify)s

-- name: enqueue
-- publish_plain without its wake-up, which the wake query sends right after it in a
-- transaction of its own (see Store.publish_on).
INSERT INTO {schema}.message (queue, priority, visible_at, publish_key, payload)
VALUES (%(queue)s, %(priority)s, now() + make_interval(secs => %(delay)s),
        %(publish_key)s, %(payload)s)
ON CONFLICT (publish_key) DO NOTHING

-- name: wake
-- Wake the listeners of the schema's channel for a message of queue that an enqueue
-- committed just before. Postgres commits the transactions that NOTIFY one at a time:
-- each holds a lock until its commit is done, WAL flush included. Alone, a wake-up
-- writes no WAL and commits without a flush, so it holds that lock only briefly, and
-- the durable commit of the enqueue before it joins other sessions' flushes (group
-- commit) instead of waiting for each of them in turn.
SELECT pg_notify(%(channel)s, %(queue)s)

-- name: settle
-- Sent right behind a publish (or publish_routed) with settle_follows set, as a
-- transaction of its own: what that statement left to do in pg_transport.settle. A
-- JSON array: the queues it inserted into without handing the message over, committed
-- as the session says; their listeners are woken now, as the wake query does. 'flush':
-- it handed the message over unflushed; this is flush_wal. '': nothing is left (a
-- hand-off committed as the session says). Unset (a session's first publish inserted
-- nothing, the key being there): queue's listeners are woken, at worst a wake-up too
-- many. Its commit waits for the flush only if it wrote WAL: after a 'flush'.
WITH todo AS (
    SELECT coalesce(current_setting('pg_transport.settle', true),
                    json_build_array(%(queue)s::text)::text) AS what
)
SELECT (SELECT count(pg_logical_emit_message(true, 'pgq', ''))
        FROM todo WHERE what = 'flush')
     + (SELECT count(pg_notify(%(channel)s, woken.queue))
        FROM todo,
             json_array_elements_text(CASE WHEN left(what, 1) = '[' THEN what::json END)
                 AS woken (queue)
        WHERE woken.queue IS NOT NULL)

-- name: claim
-- Take up to limit visible messages over several queues in one statement. A message
-- whose next delivery would exceed its queue's max_attempts is moved to dead_letter
-- instead, in the same statement: it is never delivered again and never lost.
-- Rows come back in delivery order: priority, then the time they became visible.
-- The same statement acks (deletes, fenced by read_ct) the messages in ack_ids, which
-- are never picked: an ack whose lease lapsed must not race its own redelivery.
-- A consumer that registers (waiter set) waits on its queues when the claim comes back
-- empty and stops waiting when it brings messages (waiting, unwaited below).
-- Shaped for one cached generic plan (no planning per claim): the picked rows are
-- reached by primary key (id = ANY), never by a join the planner could turn into a
-- scan of the whole table when it cannot see the limit.
WITH wanted AS (
    SELECT w.name, w.vt, w.max_attempts
    FROM unnest(%(queues)s::text[], %(vts)s::float8[], %(max_attempts)s::integer[])
        AS w(name, vt, max_attempts)
), acked AS (
    DELETE FROM {schema}.message AS m
    USING unnest(%(ack_ids)s::bigint[], %(ack_read_cts)s::integer[]) AS a(id, read_ct)
    WHERE m.id = a.id AND m.read_ct = a.read_ct
), levels AS (
    -- The priorities present in each wanted queue, highest first: one index descent
    -- per priority (a skip scan), whatever lies between them.
    WITH RECURSIVE level AS (
        SELECT w.name, (SELECT m.priority FROM {schema}.message AS m
                        WHERE m.queue = w.name ORDER BY m.priority DESC LIMIT 1) AS priority
        FROM wanted AS w
        UNION ALL
        SELECT l.name, (SELECT m.priority FROM {schema}.message AS m
                        WHERE m.queue = l.name AND m.priority < l.priority
                        ORDER BY m.priority DESC LIMIT 1)
        FROM level AS l WHERE l.priority IS NOT NULL
    )
    SELECT name, priority FROM level WHERE priority IS NOT NULL
), picked AS MATERIALIZED (
    SELECT c.id, c.priority, c.visible_at, c.read_ct, wanted.vt, wanted.max_attempts
    FROM levels JOIN wanted ON wanted.name = levels.name
    CROSS JOIN LATERAL (
        SELECT m.id, m.priority, m.visible_at, m.read_ct
        FROM {schema}.message AS m
        WHERE m.queue = levels.name AND m.priority = levels.priority
          AND m.visible_at <= now()
          AND (m.expires_at IS NULL OR m.expires_at > now())
          AND m.id <> ALL(%(ack_ids)s::bigint[])
        ORDER BY m.visible_at, m.id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS c
    ORDER BY c.priority DESC, c.visible_at, c.id
    LIMIT %(limit)s
), poisoned AS (
    DELETE FROM {schema}.message AS t
    WHERE t.id = ANY(ARRAY(SELECT id FROM picked WHERE read_ct >= max_attempts))
    RETURNING t.id, t.queue, t.priority, t.read_ct, t.enqueued_at, t.payload
), dead AS (
    INSERT INTO {schema}.dead_letter
        (message_id, queue, priority, read_ct, enqueued_at, reason, payload)
    SELECT p.id, p.queue, p.priority, p.read_ct, p.enqueued_at,
           format('delivered %%s times; max_attempts is %%s', p.read_ct, picked.max_attempts),
           p.payload
    FROM poisoned AS p JOIN picked ON picked.id = p.id
    RETURNING id, message_id
), claimed AS (
    UPDATE {schema}.message AS t
    SET visible_at = now() + make_interval(secs => (
            SELECT picked.vt FROM picked WHERE picked.id = t.id)),
        read_ct = t.read_ct + 1
    WHERE t.id = ANY(ARRAY(SELECT id FROM picked WHERE read_ct < max_attempts))
    RETURNING t.id, t.queue, t.priority, t.read_ct, t.payload
), delivered AS (
    SELECT id, queue, priority, read_ct, payload, NULL::bigint AS dead_letter_id FROM claimed
    UNION ALL
    SELECT p.id, p.queue, p.priority, p.read_ct, p.payload, d.id
    FROM poisoned AS p JOIN dead AS d ON d.message_id = p.id
), waiting AS (
    -- Came back empty: the consumer (waiter, its session's token) is idle and waits on
    -- wait_queues, and the next publish to one of them hands its message over (see
    -- publish). A consumer sends wait_queues only while it waits nowhere.
    INSERT INTO {schema}.waiter (consumer, queue, vt)
    SELECT %(waiter)s, r.queue, r.vt
    FROM unnest(%(wait_queues)s::text[], %(wait_vts)s::float8[]) AS r(queue, vt)
    WHERE NOT EXISTS (SELECT 1 FROM delivered)
), unwaited AS (
    -- Came back with messages: the consumer is busy and waits no more. Waits for a
    -- publisher taking this consumer right now; fewer rows deleted than the consumer
    -- waited with (the last column) means a hand-off is on its way.
    DELETE FROM {schema}.waiter AS w
    WHERE %(unwait)s AND w.consumer = %(waiter)s AND EXISTS (SELECT 1 FROM delivered)
    RETURNING 1
)
SELECT delivered.id, delivered.queue, delivered.priority, delivered.read_ct,
       delivered.payload, delivered.dead_letter_id, (SELECT count(*) FROM unwaited)
FROM delivered JOIN picked ON picked.id = delivered.id
ORDER BY picked.priority DESC, picked.visible_at, picked.id

-- name: pop
-- Take and delete up to limit visible messages at once, for consumers that never ack
-- (no_ack). Rows come back in delivery order; reached by primary key, as in claim.
WITH wanted AS (
    SELECT w.name FROM unnest(%(queues)s::text[]) AS w(name)
), picked AS MATERIALIZED (
    SELECT c.id, c.priority, c.visible_at
    FROM wanted
    CROSS JOIN LATERAL (
        SELECT m.id, m.priority, m.visible_at
        FROM {schema}.message AS m
        WHERE m.queue = wanted.name AND m.visible_at <= now()
          AND (m.expires_at IS NULL OR m.expires_at > now())
        ORDER BY m.priority DESC, m.visible_at, m.id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS c
    ORDER BY c.priority DESC, c.visible_at, c.id
    LIMIT %(limit)s
), popped AS (
    DELETE FROM {schema}.message AS t
    WHERE t.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING t.id, t.queue, t.priority, t.read_ct + 1 AS read_ct, t.payload
)
SELECT popped.id, popped.queue, popped.priority, popped.read_ct, popped.payload, NULL::bigint
FROM popped JOIN picked ON picked.id = popped.id
ORDER BY picked.priority DESC, picked.visible_at, picked.id

-- name: ack
-- Delete delivered messages, fenced by the read_ct each was claimed with.
DELETE FROM {schema}.message AS m
USING unnest(%(ids)s::bigint[], %(read_cts)s::integer[]) AS a(id, read_ct)
WHERE m.id = a.id AND m.read_ct = a.read_ct

-- name: release
-- Make claimed messages visible again now (requeue), fenced by read_ct, and wake
-- listeners. A released message goes back to the place it had when it was published
-- (visible since enqueued_at), ahead of what arrived after it, as on AMQP brokers.
WITH released AS (
    UPDATE {schema}.message AS m
    SET visible_at = least(m.enqueued_at, now())
    FROM unnest(%(ids)s::bigint[], %(read_cts)s::integer[]) AS a(id, read_ct)
    WHERE m.id = a.id AND m.read_ct = a.read_ct
    RETURNING m.queue
)
SELECT pg_notify(%(channel)s, q.queue) FROM (SELECT DISTINCT queue FROM released) AS q

-- name: renew
-- Extend the visibility timeout of messages this consumer still holds.
UPDATE {schema}.message AS m
SET visible_at = now() + make_interval(secs => a.vt)
FROM unnest(%(ids)s::bigint[], %(read_cts)s::integer[], %(vts)s::float8[]) AS a(id, read_ct, vt)
WHERE m.id = a.id AND m.read_ct = a.read_ct

-- name: dead_letter
-- Move one claimed message to dead_letter with a reason, fenced by read_ct.
WITH moved AS (
    DELETE FROM {schema}.message
    WHERE id = %(id)s AND read_ct = %(read_ct)s
    RETURNING id, queue, priority, read_ct, enqueued_at, payload
)
INSERT INTO {schema}.dead_letter
    (message_id, queue, priority, read_ct, enqueued_at, reason, payload)
SELECT id, queue, priority, read_ct, enqueued_at, %(reason)s, payload
FROM moved
RETURNING id

-- name: dead_letter_identify
-- Record what was recovered of a dead-lettered message: task, identity, reasons.
UPDATE {schema}.dead_letter
SET task_id = %(task_id)s, task_name = %(task_name)s, identity = %(identity)s,
    reason = reason || %(note)s
WHERE id = %(id)s

-- name: dead_letter_hooks
-- Record the outcome of every message_poisoned handler for a dead-letter row.
UPDATE {schema}.dead_letter SET hooks = %(hooks)s WHERE id = %(id)s

-- name: dead_letter_get
-- One dead-letter row.
SELECT id, message_id, queue, priority, read_ct, enqueued_at, dead_at, reason, task_id,
       task_name, identity, hooks, payload
FROM {schema}.dead_letter WHERE id = %(id)s

-- name: size
-- Count the messages of a queue that are ready for delivery now.
SELECT count(*) FROM {schema}.message WHERE queue = %(queue)s AND visible_at <= now()

-- name: purge
-- Delete a queue's waiting messages (ready or delayed, not in flight); return how many.
WITH purged AS (
    DELETE FROM {schema}.message
    WHERE queue = %(queue)s AND (visible_at <= now() OR read_ct = 0)
    RETURNING 1
)
SELECT count(*) FROM purged

-- name: declare_queue
-- Record a declared queue; declaring again updates its expiry and TTL and counts as use.
INSERT INTO {schema}.queue (name, expires_ms, message_ttl_ms)
VALUES (%(queue)s, %(expires_ms)s, %(message_ttl_ms)s)
ON CONFLICT (name) DO UPDATE
SET expires_ms = EXCLUDED.expires_ms, message_ttl_ms = EXCLUDED.message_ttl_ms, last_used = now()

-- name: has_queue
-- Whether a queue has been declared.
SELECT EXISTS (SELECT 1 FROM {schema}.queue WHERE name = %(queue)s)

-- name: delete_queue
-- Forget a queue, its bindings and every message in it.
WITH gone AS (DELETE FROM {schema}.queue WHERE name = %(queue)s),
unbound AS (DELETE FROM {schema}.binding WHERE queue = %(queue)s)
DELETE FROM {schema}.message WHERE queue = %(queue)s

-- name: declare_exchange
-- Record an exchange; return the type it has (an existing exchange keeps its type).
-- DO UPDATE, not DO NOTHING + SELECT: the SELECT's snapshot predates a concurrent
-- declarer's commit and finds no row; DO UPDATE waits for it and returns its row.
INSERT INTO {schema}.exchange AS e (name, type) VALUES (%(exchange)s, %(type)s)
ON CONFLICT (name) DO UPDATE SET type = e.type
RETURNING e.type

-- name: exchange_type
-- The type of a declared exchange (no row when it was never declared).
SELECT type FROM {schema}.exchange WHERE name = %(exchange)s

-- name: delete_exchange
-- Forget an exchange and its bindings.
WITH unbound AS (DELETE FROM {schema}.binding WHERE exchange = %(exchange)s)
DELETE FROM {schema}.exchange WHERE name = %(exchange)s

-- name: bind
-- Bind a queue to a declared exchange; true when the exchange exists.
WITH found AS (
    SELECT name FROM {schema}.exchange WHERE name = %(exchange)s
), inserted AS (
    INSERT INTO {schema}.binding (exchange, queue, routing_key, pattern)
    SELECT found.name, %(queue)s, %(routing_key)s, %(pattern)s FROM found
    ON CONFLICT (exchange, routing_key, queue) DO NOTHING
)
SELECT EXISTS (SELECT 1 FROM found)

-- name: unbind
-- Remove one binding.
DELETE FROM {schema}.binding
WHERE exchange = %(exchange)s AND queue = %(queue)s AND routing_key = %(routing_key)s

-- name: list_bindings
-- Every binding: (queue, exchange, routing_key).
SELECT queue, exchange, routing_key FROM {schema}.binding ORDER BY exchange, routing_key, queue

-- name: publish_routed
-- Route by the exchange's bindings and insert one message per matched queue, in one
-- statement: no process needs to know the bindings other processes made. Returns
-- the exchange's type (NULL: never declared) and how many queues matched. With
-- handoff set and a single matched queue, the message goes to a waiting live consumer
-- of that queue where there is one, as in publish, if the NOTIFY has room for it
-- (handoff_room: bytes left for the queue name, which JSON-escaping may make up to 6
-- times longer). With deliver_unflushed set, a hand-off commits without waiting for its
-- WAL flush and the fourth column says so, as in publish: the publisher runs flush_wal.
-- With settle_follows set, the listeners are left to settle, as in publish.
WITH ex AS (
    SELECT type FROM {schema}.exchange WHERE name = %(exchange)s
), targets AS (
    SELECT DISTINCT b.queue
    FROM {schema}.binding AS b CROSS JOIN ex
    WHERE b.exchange = %(exchange)s
      AND CASE ex.type
              WHEN 'fanout' THEN true
              WHEN 'topic' THEN %(routing_key)s ~ b.pattern
              ELSE b.routing_key = %(routing_key)s
          END
), candidate AS (
    -- As in publish, where the message goes to exactly one queue: a hand-off of copies
    -- to several queues could reach one consumer several times for one wait.
    SELECT c.consumer
    FROM targets AS t
    CROSS JOIN LATERAL (
        SELECT w.consumer FROM {schema}.waiter AS w
        WHERE %(handoff)s AND (SELECT count(*) FROM targets) = 1 AND w.queue = t.queue
          AND 6 * octet_length(t.queue) <= %(handoff_room)s
          AND NOT pg_try_advisory_xact_lock_shared(%(lock_space)s, w.consumer)
          AND pg_try_advisory_xact_lock(%(take_space)s, w.consumer)
        ORDER BY w.id
        LIMIT 1
    ) AS c
), taken AS (
    DELETE FROM {schema}.waiter AS w
    WHERE w.consumer = (SELECT consumer FROM candidate)
    RETURNING w.queue, w.consumer, w.vt
), taker AS (
    SELECT k.queue, k.consumer, k.vt FROM taken AS k JOIN targets AS t ON t.queue = k.queue
), inserted AS (
    INSERT INTO {schema}.message
        (queue, priority, visible_at, read_ct, publish_key, payload, expires_at)
    SELECT t.queue, %(priority)s,
           CASE WHEN k.consumer IS NULL
                THEN now() + make_interval(secs => %(delay)s)
                ELSE clock_timestamp() + make_interval(secs => k.vt) END,
           CASE WHEN k.consumer IS NULL THEN 0 ELSE 1 END,
           md5(%(publish_tag)s || t.queue), %(payload)s,
           now() + make_interval(secs => least(q.message_ttl_ms / 1000.0, %(ttl)s))
    FROM targets AS t
    LEFT JOIN {schema}.queue AS q ON q.name = t.queue
    LEFT JOIN taker AS k ON k.queue = t.queue
    ON CONFLICT (publish_key) DO NOTHING
    RETURNING id, queue, priority, payload
), handed AS (
    SELECT i.queue, pg_notify(%(handoff_prefix)s || k.consumer,
                              json_build_array(i.id, i.queue, i.priority, i.payload)::text)
    FROM inserted AS i JOIN taker AS k ON k.queue = i.queue
), unhanded AS (
    -- Every matched queue whose copy was not handed over, inserted now or found there:
    -- a publish sent again after its session was lost finds its copies committed, and
    -- their wake-up may have been lost with that session (settle's, or a listener's
    -- missed). At worst a wake-up too many.
    SELECT t.queue FROM targets AS t WHERE t.queue NOT IN (SELECT queue FROM handed)
), woken AS (
    SELECT pg_notify(%(channel)s, u.queue) FROM unhanded AS u
    WHERE %(notify)s AND NOT %(settle_follows)s
)
SELECT (SELECT type FROM ex), (SELECT count(*) FROM targets),
       (SELECT count(*) FROM woken) + (SELECT count(*) FROM handed),
       CASE WHEN %(deliver_unflushed)s AND (SELECT count(*) FROM handed) > 0
            THEN set_config('synchronous_commit', 'off', true) IS NOT NULL
            ELSE false
       END AS unflushed,
       %(settle_follows)s AND set_config(
           'pg_transport.settle',
           CASE WHEN (SELECT count(*) FROM handed) = 0
                THEN coalesce((SELECT json_agg(u.queue) FROM unhanded AS u), '[]')::text
                WHEN %(deliver_unflushed)s THEN 'flush'
                ELSE '' END,
           false
       ) IS NOT NULL

-- name: dead_letter_unroutable
-- Keep a message no queue was bound to receive, under its routing key as queue name.
INSERT INTO {schema}.dead_letter
    (message_id, queue, priority, read_ct, enqueued_at, reason, payload)
VALUES (0, %(queue)s, %(priority)s, 0, now(), %(reason)s, %(payload)s)
RETURNING id

-- name: maintain
-- Mark the queues this consumer uses as in use; delete queues unused past their
-- expiry (with their bindings), queued messages past their TTL and the waiters of
-- consumers that are gone. Not on a consumer's own session. Returns the names
-- of the deleted queues (drop_messages then deletes their messages) and how many
-- messages expired. Safe to run from every consumer at once.
WITH touched AS (
    UPDATE {schema}.queue SET last_used = now() WHERE name = ANY(%(queues)s::text[])
    RETURNING name
), gone AS (
    DELETE FROM {schema}.queue AS q
    WHERE q.expires_ms IS NOT NULL
      AND q.last_used + make_interval(secs => q.expires_ms / 1000.0) < now()
      AND q.name <> ALL(%(queues)s::text[])
    RETURNING q.name
), unbound AS (
    DELETE FROM {schema}.binding AS b WHERE b.queue = ANY(ARRAY(SELECT name FROM gone))
), expired AS (
    DELETE FROM {schema}.message AS m
    WHERE m.expires_at < now() AND (m.read_ct = 0 OR m.visible_at <= now())
    RETURNING 1
), departed AS (
    -- Waiters whose consumer is gone (its advisory lock is free to take).
    DELETE FROM {schema}.waiter AS w
    WHERE w.id = ANY(ARRAY(
        SELECT x.id FROM {schema}.waiter AS x
        WHERE pg_try_advisory_xact_lock_shared(%(lock_space)s, x.consumer)
        FOR UPDATE SKIP LOCKED))
)
SELECT ARRAY(SELECT name FROM gone), (SELECT count(*) FROM expired)

-- name: drop_messages
-- Delete every message of the given queues (queues that expired). A statement of its
-- own, planned for the names it gets: a join on queue names the planner cannot see
-- could become a scan of every message.
DELETE FROM {schema}.message WHERE queue = ANY(%(queues)s::text[])

-- name: dead_rows
-- Dead row versions in the message and waiter tables (cumulative statistics, a second
-- or so behind) and whether this role may vacuum them (its owner or a member of the
-- owner): one row per table.
SELECT s.relname, s.n_dead_tup, pg_catalog.pg_has_role(current_user, c.relowner, 'USAGE')
FROM pg_catalog.pg_stat_user_tables AS s
JOIN pg_catalog.pg_class AS c ON c.oid = s.relid
WHERE s.schemaname = %(schema)s AND s.relname IN ('message', 'waiter')

-- name: vacuum
-- Remove the message table's dead rows; skipped when another VACUUM holds the table.
VACUUM (SKIP_LOCKED) {schema}.message

-- name: vacuum_waiter
-- Remove the waiter table's dead rows (every hand-off leaves one).
VACUUM (SKIP_LOCKED) {schema}.waiter

-- name: has_version_table
-- Whether the schema has been created (its version table exists). A plain query
-- of pg_class, not to_regclass(): after waiting on the migration lock the catalog
-- cache may predate the winner's commit, a fresh statement snapshot does not.
SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_class AS c
    JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = %(schema)s AND c.relname = 'schema_version'
)

-- name: applied_version
-- The highest migration applied (the table is known to exist).
SELECT coalesce(max(version), 0) FROM {schema}.schema_version

-- name: record_version
-- Record an applied migration.
INSERT INTO {schema}.schema_version (version) VALUES (%(version)s)

-- name: create_schema
-- Create the schema itself (migrations create what is in it).
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: migrate_lock
-- Serialise migrations of one schema across processes until the transaction ends.
SELECT pg_advisory_xact_lock(%(key)s)

-- name: listen
-- Subscribe this session to the schema's wake-up channel.
LISTEN {channel}

-- name: listen_handoff
-- Subscribe a consumer's session to its own channel, where publishes hand it messages.
LISTEN {handoff}

-- name: hold_token
-- Take a consumer token for this session: publishes hand messages only to consumers
-- whose session holds this lock (false: the token is taken, try another).
SELECT pg_try_advisory_lock(%(lock_space)s, %(token)s)

-- name: ping
-- A round trip: notifications of transactions that finished committing before it
-- arrive first. Not those of a commit under way (its NOTIFY goes out after its locks
-- are released): that is what unwait's count is for. The tests read sessions with it.
SELECT 1

-- name: unwait
-- A consumer leaving: it waits on nothing any more. Waits for a publisher handing it a
-- message right now; fewer rows gone than the consumer registered means one took it
-- (its hand-off is committed, the NOTIFY on its way).
WITH gone AS (
    DELETE FROM {schema}.waiter WHERE consumer = %(waiter)s RETURNING 1
)
SELECT count(*) FROM gone

-- name: create_schema_strict
-- Create a schema that must not exist yet (the demo drops only what it created).
CREATE SCHEMA {schema}

-- name: drop_schema
-- Drop a throwaway schema and everything in it.
DROP SCHEMA {schema} CASCADE

-- name: generic_plans
-- For the consumer's own sessions (claim, ack, release, renew): plan each prepared
-- statement once. Those queries are shaped so that their generic plan is the index
-- plan (tests/integration/test_plans.py); planning a claim costs more than running it.
SET plan_cache_mode TO force_generic_plan

-- name: no_jit
-- For pgq's own sessions: every statement touches a handful of rows, and compiling one
-- with JIT (which a prepared claim's cost estimate at a deep backlog triggers) takes
-- hundreds of milliseconds, at every execution.
SET jit TO off

-- name: relax_commit
-- For sessions that only claim, ack, release and renew: a commit lost in a server
-- crash makes a message visible again (delivered twice), it never loses one.
SET synchronous_commit TO off

-- name: flush_wal
-- Run after a publish that committed unflushed (see publish), as a transaction of its
-- own committed as the session's synchronous_commit says (durable by default): WAL is
-- flushed in order, so this flush covers the earlier commit, whichever server session
-- made it. Its commit waits for the flush only if it wrote WAL: a logical decoding
-- message (prefix 'pgq', empty) is the smallest record that does, touching no table.
SELECT pg_logical_emit_message(true, 'pgq', '')

-- name: can_flush_wal
-- Whether this role may run flush_wal (whatever the function's signature on this
-- server version).
SELECT coalesce(bool_or(has_function_privilege(p.oid, 'EXECUTE')), false)
FROM pg_catalog.pg_proc AS p
WHERE p.proname = 'pg_logical_emit_message'
  AND p.pronamespace = 'pg_catalog'::regnamespace
  AND p.proargtypes[2] = 'text'::regtype

-- name: schema_owner
-- The role owning the schema, or no row when the schema does not exist.
SELECT nspowner::regrole::text FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s

-- Named queries of pgq. Each block starts with "-- name: <name>" and a one-line
-- description; {schema} is composed as an identifier, values are bound.
-- Every function is called by its schema-qualified name and parameters are cast where
-- an operator takes them: a role that may CREATE in public (the default before
-- Postgres 15) could otherwise plant a better-matching unnest() or count() that pgq's
-- sessions would call as themselves. Sessions that are pgq's own also pin search_path
-- (connection.py); behind a transaction pooler they cannot, and this is what holds.
-- A notification carries nothing: its channel names a queue (queue_channel, a digest
-- of the schema and the queue name) and its payload is empty. Whoever may connect may
-- send one on any channel, so a consumer only ever takes it as a reason to claim.

-- name: publish_plain
-- Insert one message (a retried publish with the same key is a no-op) and wake its
-- queue's listeners (for a delayed message too: they ask when it falls due). Where the
-- publisher's session is its own (not behind a transaction pooler), idle, and its
-- commits wait for their flush, a publish runs enqueue and wake instead, as two
-- transactions sent at once (publisher.py, way_of).
-- The message expires after the shorter of its own ttl (seconds, the message's
-- expiration) and its queue's x-message-ttl, counted from now, as publish_routed does;
-- neither set: it never expires.
WITH inserted AS (
    INSERT INTO {schema}.message (queue, priority, visible_at, publish_key, payload, expires_at,
                                  okey, task_id, follows, follow_until, followable, fkey)
    VALUES (%(queue)s, %(priority)s,
            pg_catalog.now() + pg_catalog.make_interval(secs => %(delay)s::float8),
            %(publish_key)s, %(payload)s,
            pg_catalog.now() + pg_catalog.make_interval(secs => LEAST(
                (SELECT q.message_ttl_ms::float8 / 1000.0::float8
                 FROM {schema}.queue AS q WHERE q.name = %(queue)s::text),
                %(ttl)s::float8)),
            %(okey)s::text, %(task_id)s::text, %(follows)s::text,
            pg_catalog.now() + pg_catalog.make_interval(
                secs => %(delay)s::float8 + %(follow_wait)s::float8),
            %(followable)s::boolean,
            CASE WHEN (SELECT q.fair FROM {schema}.queue AS q WHERE q.name = %(queue)s::text)
                 THEN COALESCE(%(fkey)s::text, '') END)
    ON CONFLICT (publish_key) DO NOTHING
    RETURNING 1
)
SELECT pg_catalog.pg_notify(%(channel)s::text, '') FROM inserted

-- name: publish_unique
-- publish_plain for a message with a unique key (0017_unique_fair.sql): any conflict inserts
-- nothing, a publish sent again (publish key) or a duplicate (ukey). The insert waits for
-- a transaction that inserted the same key and has not ended, at most unique_wait (the
-- statement's lock_timeout, set first, local to the transaction; its value before is
-- returned for a caller's transaction to put back). Which conflict it was is asked only
-- when nothing was inserted: unique_holder names the task that holds the key (this
-- publish's own task id: it is this publish, sent again), or NULL when none does any more.
WITH waits AS MATERIALIZED (
    SELECT pg_catalog.current_setting('lock_timeout') AS before,
           pg_catalog.set_config('lock_timeout', %(unique_wait)s::text, true) AS set
), inserted AS (
    INSERT INTO {schema}.message (queue, priority, visible_at, publish_key, payload, expires_at,
                                  okey, task_id, follows, follow_until, followable, ukey, urun,
                                  fkey)
    SELECT %(queue)s, %(priority)s,
           pg_catalog.now() + pg_catalog.make_interval(secs => %(delay)s::float8),
           %(publish_key)s, %(payload)s,
           pg_catalog.now() + pg_catalog.make_interval(secs => LEAST(
               (SELECT q.message_ttl_ms::float8 / 1000.0::float8
                FROM {schema}.queue AS q WHERE q.name = %(queue)s::text),
               %(ttl)s::float8)),
           %(okey)s::text, %(task_id)s::text, %(follows)s::text,
           pg_catalog.now() + pg_catalog.make_interval(
               secs => %(delay)s::float8 + %(follow_wait)s::float8),
           %(followable)s::boolean, %(ukey)s::text, %(urun)s::boolean,
           CASE WHEN (SELECT q.fair FROM {schema}.queue AS q WHERE q.name = %(queue)s::text)
                THEN COALESCE(%(fkey)s::text, '') END
    FROM waits
    ON CONFLICT DO NOTHING
    RETURNING 1
), woken AS (
    SELECT pg_catalog.pg_notify(%(channel)s::text, '') FROM inserted
)
SELECT (SELECT pg_catalog.count(*) FROM inserted) AS inserted,
       (SELECT pg_catalog.count(*) FROM woken) AS woken,
       CASE WHEN NOT EXISTS (SELECT FROM inserted)
            THEN {schema}.unique_holder(%(ukey)s::text, %(publish_key)s::text) END AS holder,
       (SELECT w.before FROM waits AS w) AS lock_timeout

-- name: lock_timeout_restore
-- Put back the lock_timeout a unique publish set in a caller's transaction.
SELECT pg_catalog.set_config('lock_timeout', %(lock_timeout)s::text, true)

-- name: publish_many
-- The messages of a batch (pg_transport.batch(), kombu's Producer.batch()) in one
-- statement: one array a column (sent in binary: nothing to escape), one element a
-- message, inserted in array order (their
-- ids, and so their order in an ordering key, follow the publishes). Each is what
-- publish_plain inserts for it (a retried publish key inserts nothing, the same expiry);
-- the listeners of each queue of the batch are woken once, at the commit, if any of its
-- messages was inserted (RETURNING names no column: a publisher may not read messages).
WITH given AS (
    SELECT g.*
    FROM ROWS FROM (pg_catalog.unnest(%(queue)b::text[]),
                    pg_catalog.unnest(%(priority)b::int[]),
                    pg_catalog.unnest(%(delay)b::float8[]),
                    pg_catalog.unnest(%(publish_key)b::text[]),
                    pg_catalog.unnest(%(payload)b::text[]),
                    pg_catalog.unnest(%(ttl)b::float8[]),
                    pg_catalog.unnest(%(okey)b::text[]),
                    pg_catalog.unnest(%(task_id)b::text[]),
                    pg_catalog.unnest(%(follows)b::text[]),
                    pg_catalog.unnest(%(follow_wait)b::float8[]),
                    pg_catalog.unnest(%(followable)b::boolean[]),
                    pg_catalog.unnest(%(channel)b::text[]),
                    pg_catalog.unnest(%(fkey)b::text[]))
         WITH ORDINALITY AS g(queue, priority, delay, publish_key, payload, ttl, okey,
                              task_id, follows, follow_wait, followable, channel, fkey, n)
), inserted AS (
    INSERT INTO {schema}.message (queue, priority, visible_at, publish_key, payload, expires_at,
                                  okey, task_id, follows, follow_until, followable, fkey)
    SELECT g.queue, g.priority,
           pg_catalog.now() + pg_catalog.make_interval(secs => g.delay),
           g.publish_key, g.payload::json,
           pg_catalog.now() + pg_catalog.make_interval(secs => LEAST(
               (SELECT q.message_ttl_ms::float8 / 1000.0::float8
                FROM {schema}.queue AS q WHERE q.name = g.queue),
               g.ttl)),
           g.okey, g.task_id, g.follows,
           pg_catalog.now() + pg_catalog.make_interval(secs => g.delay + g.follow_wait),
           g.followable,
           CASE WHEN (SELECT q.fair FROM {schema}.queue AS q WHERE q.name = g.queue)
                THEN COALESCE(g.fkey, '') END
    FROM given AS g
    ORDER BY g.n
    ON CONFLICT (publish_key) DO NOTHING
    RETURNING 1
)
SELECT pg_catalog.pg_notify(w.channel, '')
FROM (SELECT DISTINCT g.channel FROM given AS g) AS w
WHERE EXISTS (SELECT FROM inserted)

-- name: server_identity
-- Which database of which running server a session is on: the cluster's system
-- identifier (a copy made from a base backup shares it), when the server started (which
-- tells such copies apart), the database, and where the server says it listens (for
-- error messages only: behind a pooler it is the pooler's side of the server).
SELECT c.system_identifier::text, pg_catalog.pg_postmaster_start_time()::text,
       pg_catalog.current_database()::text,
       pg_catalog.host(pg_catalog.inet_server_addr()),
       pg_catalog.inet_server_port()
FROM pg_catalog.pg_control_system() AS c

-- name: enqueue
-- publish_plain without its wake-up, which the wake query sends right after it in a
-- transaction of its own (see Publisher._enqueue_then_wake). It expires as there.
INSERT INTO {schema}.message (queue, priority, visible_at, publish_key, payload, expires_at,
                                  okey, task_id, follows, follow_until, followable, fkey)
VALUES (%(queue)s, %(priority)s,
        pg_catalog.now() + pg_catalog.make_interval(secs => %(delay)s::float8),
        %(publish_key)s, %(payload)s,
        pg_catalog.now() + pg_catalog.make_interval(secs => LEAST(
            (SELECT q.message_ttl_ms::float8 / 1000.0::float8
             FROM {schema}.queue AS q WHERE q.name = %(queue)s::text),
            %(ttl)s::float8)),
        %(okey)s::text, %(task_id)s::text, %(follows)s::text,
        pg_catalog.now() + pg_catalog.make_interval(
            secs => %(delay)s::float8 + %(follow_wait)s::float8),
        %(followable)s::boolean,
        CASE WHEN (SELECT q.fair FROM {schema}.queue AS q WHERE q.name = %(queue)s::text)
             THEN COALESCE(%(fkey)s::text, '') END)
ON CONFLICT (publish_key) DO NOTHING

-- name: wake
-- Wake the listeners of a queue whose message an enqueue committed just before.
-- Postgres commits the transactions that NOTIFY one at a time: each holds a lock until
-- its commit is done, WAL flush included. Alone, a wake-up writes no WAL and commits
-- without a flush, so it holds that lock only briefly, and the durable commit of the
-- enqueue before it joins other sessions' flushes (group commit) instead of waiting for
-- each of them in turn. Sent after the enqueue's commit, it also never wakes a consumer
-- for a message that is not on disk yet.
SELECT pg_catalog.pg_notify(%(channel)s::text, '')

-- name: claim
-- Take up to limit visible messages over several queues in one statement, and at most
-- max_bytes of payload (always at least one message); the same statement acks the
-- messages in ack_ids. Rows come back in delivery order: priority, then the time they
-- became visible; then the rows held back (note held, no payload: they count against
-- limit, so the caller must not take a short answer for an empty queue); then the acks
-- the fencing refused (note refused).
-- One round trip, read as named parts (each a "-- part:" below, composed in by the
-- loader; docs/design/claim.md says why):
--   ack          claim_ack                       the acks riding on the claim
--   pick         claim_levels, claim_pick        ready rows of each queue, locked
--   gates        claim_gate_key                  one message of a key at a time, in order
--                claim_gate_follows              a follower after the task it follows
--                claim_hold, claim_park          what a gate stops is held or parked
--                claim_handoff                   an ack here hands its key's next on
--   budget       claim_budget                    limit and max_bytes over what passed
--   doom         claim_doom, claim_dead          never delivered, never lost
--   update       claim_update                    the lease
--   answer       claim_delivered, claim_answer   (claim_limits: a flow limit exists;
--                                                claim_featured: it met a keyed message)
--   commit       claim_relax                     behind a pooler: how it commits
-- It carries no flow gate: when any flow limit exists (claim_flow_on, in its snapshot)
-- it picks nothing, hands nothing on, lands its acks and answers the row claim_limits,
-- and the caller sends flow_claim instead (docs/design/claim.md, "Flow limits").
-- Shaped for one cached generic plan (no planning per claim): rows picked are reached
-- by primary key (id = ANY), never by a join the planner could turn into a scan of the
-- whole table when it cannot see the limit. Checks that take no lock are scalar
-- subqueries with LIMIT 1, not EXISTS: the planner may turn an EXISTS into a hash of
-- every row it could match.
WITH wanted AS (
    SELECT w.name, w.vt, w.max_attempts, false AS fair
    FROM ROWS FROM (pg_catalog.unnest(%(queues)s::text[]),
                    pg_catalog.unnest(%(vts)s::float8[]),
                    pg_catalog.unnest(%(max_attempts)s::integer[]))
        AS w(name, vt, max_attempts)
    WHERE {part:claim_relax} AND {part:claim_flow_on} IS NULL
), acked AS (
    {part:claim_ack}
), levels AS (
    {part:claim_levels}
), candidates AS MATERIALIZED (
    {part:claim_pick}
), gated AS MATERIALIZED (
    SELECT c.*, {part:claim_gate_key} AS key_gate,
           {part:claim_gate_follows} AS follow_gate
    FROM candidates AS c
), held AS MATERIALIZED (
    {part:claim_hold}
), parked AS (
    {part:claim_park}
), handed AS MATERIALIZED (
    {part:claim_handoff}
), picked AS MATERIALIZED (
    {part:claim_budget}
), poisoned AS (
    {part:claim_dead}
), dead AS (
    {part:claim_dead_letter}
), claimed AS (
    {part:claim_update}
), stopped AS (
    SELECT id, queue, priority, read_ct, visible_at FROM held
), delivered AS (
    {part:claim_delivered}
)
{part:claim_answer}

-- name: lean_claim
-- The claim of the plain case (docs/design/claim.md, "The lean claim"): claim, but the
-- gates, the hold's parking and the hand-off are left out. It delivers only candidates
-- that carry no ordering key and no follows link (claim_plain), the ones every gate of
-- claim lets through without reading anything, and only when every candidate is plain
-- (claim_mixed): otherwise all come back held (not parked, not delivered: their locks
-- end with the statement) and the answer ends with the row claim_featured, so the caller
-- sends claim next, which gates them as always (in claim order: nothing overtakes). Acks
-- ride on it as on claim; an acked message of a key hands nothing on here, the trigger
-- message_leave promotes its key's next. Doom, the lease, unique keys and the flow-limit
-- guard are claim's own parts. A separate statement so that a plain queue's claim
-- carries none of the gates' plan (the executor starts every node of a cached plan,
-- whether it runs or not).
WITH wanted AS (
    SELECT w.name, w.vt, w.max_attempts, false AS fair
    FROM ROWS FROM (pg_catalog.unnest(%(queues)s::text[]),
                    pg_catalog.unnest(%(vts)s::float8[]),
                    pg_catalog.unnest(%(max_attempts)s::integer[]))
        AS w(name, vt, max_attempts)
    WHERE {part:claim_relax} AND {part:claim_flow_on} IS NULL
), acked AS (
    {part:claim_ack}
), levels AS (
    {part:claim_levels}
), candidates AS MATERIALIZED (
    {part:claim_pick}
), gated AS MATERIALIZED (
    SELECT c.*, NULL::text AS key_gate, NULL::text AS follow_gate
    FROM candidates AS c
    WHERE {part:claim_mixed} IS NULL
), held AS MATERIALIZED (
    SELECT c.id, c.queue, c.priority, c.read_ct, c.visible_at
    FROM candidates AS c
    WHERE {part:claim_mixed}
), handed AS MATERIALIZED (
    SELECT c.id, c.priority, c.visible_at, c.read_ct, c.bytes, c.kind, c.vt, c.max_attempts
    FROM candidates AS c
    WHERE false
), picked AS MATERIALIZED (
    {part:claim_budget}
), poisoned AS (
    {part:claim_dead}
), dead AS (
    {part:claim_dead_letter}
), claimed AS (
    {part:claim_update}
), stopped AS (
    SELECT id, queue, priority, read_ct, visible_at FROM held
), delivered AS (
    {part:claim_delivered}
)
{part:claim_answer}

-- name: flow_claim
-- The claim when flow limits exist (flow_limit has a row; docs/flow-control.md): claim,
-- and after the budget the flow gates, in this outline:
--   flow         claim_flow_meets                what each message asks of the limits
--                claim_gate_slots, claim_slots    at most N of a key in flight (flow_slots)
--                claim_gate_queue, claim_queue_slots  at most N of a queue (flow_queue_slots)
--                claim_flow_wants, claim_gate_rate  a token of each rate bucket (flow_tokens)
--                claim_flow_hold, claim_flow_park what the limits stop is held or deferred
--   update       claim_flow_update               the lease, and the slot it grants
--   answer       claim_flow_stopped              what the gates and the limits held back
-- Every read of a flow part is guarded by claim_flow_on, so with no limit left it is the
-- plain claim (plus those probes); its answer then lacks the row claim_limits, and the
-- caller goes back to claim. A separate statement so that the plain claim carries none
-- of it (measured: the flow parts in every claim cost plain claims 1.11-1.14x, the
-- executor's start-up of a larger statement, the parts themselves never running).
WITH wanted AS (
    SELECT w.name, w.vt, w.max_attempts, false AS fair
    FROM ROWS FROM (pg_catalog.unnest(%(queues)s::text[]),
                    pg_catalog.unnest(%(vts)s::float8[]),
                    pg_catalog.unnest(%(max_attempts)s::integer[]))
        AS w(name, vt, max_attempts)
    WHERE {part:claim_relax}
), acked AS (
    {part:claim_ack}
), levels AS (
    {part:claim_levels}
), candidates AS MATERIALIZED (
    {part:claim_pick}
), gated AS MATERIALIZED (
    SELECT c.*, {part:claim_gate_key} AS key_gate,
           {part:claim_gate_follows} AS follow_gate
    FROM candidates AS c
), held AS MATERIALIZED (
    {part:claim_hold}
), parked AS (
    {part:claim_park}
), handed AS MATERIALIZED (
    {part:claim_handoff}
), picked AS MATERIALIZED (
    {part:claim_budget}
), flow_meets AS MATERIALIZED (
    {part:claim_flow_meets}
), slots AS MATERIALIZED (
    {part:claim_gate_slots}
), slotted AS MATERIALIZED (
    {part:claim_slots}
), qslots AS MATERIALIZED (
    {part:claim_gate_queue}
), qslotted AS MATERIALIZED (
    {part:claim_queue_slots}
), flow_wants AS MATERIALIZED (
    {part:claim_flow_wants}
), rate AS MATERIALIZED (
    {part:claim_gate_rate}
), flow_held AS MATERIALIZED (
    {part:claim_flow_hold}
), flow_parked AS (
    {part:claim_flow_park}
), poisoned AS (
    {part:claim_dead}
), dead AS (
    {part:claim_dead_letter}
), claimed AS (
    {part:claim_flow_update}
), stopped AS (
    {part:claim_flow_stopped}
), delivered AS (
    {part:claim_delivered}
)
{part:claim_answer}


-- name: fair_claim
-- The claim of a consumer of at least one fair queue (queue_fair_share;
-- docs/design/flow-control.md, "Fair share"): claim, but a queue recorded fair
-- (queue.fair) is picked by claim_pick_fair, round-robin over its messages' fair keys,
-- and each fair queue's cursor is moved to the last key served (claim_fair_served,
-- claim_fair_move: a new cursor row inserted, an existing one updated through a SKIP
-- LOCKED lock). A separate statement so that a claim of plain queues only carries none
-- of it (measured: the fair parts in every claim cost plain claims about 1.3x). It
-- carries the flow gates as flow_claim does (guarded by claim_flow_on): a fair queue's
-- consumer always sends it, limits or not, and its answer's row claim_limits is only
-- a report.
WITH wanted AS (
    SELECT w.name, w.vt, w.max_attempts,
           (SELECT q.fair FROM {schema}.queue AS q WHERE q.name = w.name) IS TRUE AS fair
    FROM ROWS FROM (pg_catalog.unnest(%(queues)s::text[]),
                    pg_catalog.unnest(%(vts)s::float8[]),
                    pg_catalog.unnest(%(max_attempts)s::integer[]))
        AS w(name, vt, max_attempts)
    WHERE {part:claim_relax}
), acked AS (
    {part:claim_ack}
), levels AS (
    {part:claim_levels}
), candidates AS MATERIALIZED (
    SELECT u.* FROM (({part:claim_pick}) UNION ALL ({part:claim_pick_fair})) AS u
    ORDER BY u.priority DESC, u.visible_at, u.id
    LIMIT %(limit)s::integer
), fair_served AS MATERIALIZED (
    {part:claim_fair_served}
), fair_started AS (
    INSERT INTO {schema}.fair_cursor (queue, after)
    SELECT f.queue, f.last FROM fair_served AS f WHERE NOT f.known
    ON CONFLICT (queue) DO NOTHING
), fair_moved AS (
    {part:claim_fair_move}
), gated AS MATERIALIZED (
    SELECT c.*, {part:claim_gate_key} AS key_gate,
           {part:claim_gate_follows} AS follow_gate
    FROM candidates AS c
), held AS MATERIALIZED (
    {part:claim_hold}
), parked AS (
    {part:claim_park}
), handed AS MATERIALIZED (
    {part:claim_handoff}
), picked AS MATERIALIZED (
    {part:claim_budget}
), flow_meets AS MATERIALIZED (
    {part:claim_flow_meets}
), slots AS MATERIALIZED (
    {part:claim_gate_slots}
), slotted AS MATERIALIZED (
    {part:claim_slots}
), qslots AS MATERIALIZED (
    {part:claim_gate_queue}
), qslotted AS MATERIALIZED (
    {part:claim_queue_slots}
), flow_wants AS MATERIALIZED (
    {part:claim_flow_wants}
), rate AS MATERIALIZED (
    {part:claim_gate_rate}
), flow_held AS MATERIALIZED (
    {part:claim_flow_hold}
), flow_parked AS (
    {part:claim_flow_park}
), poisoned AS (
    {part:claim_dead}
), dead AS (
    {part:claim_dead_letter}
), claimed AS (
    {part:claim_flow_update}
), stopped AS (
    {part:claim_flow_stopped}
), delivered AS (
    {part:claim_delivered}
)
{part:claim_answer}

-- part: claim_relax
-- Behind a transaction pooler (use_notify off) no session setting outlives a statement,
-- so the claim relaxes its own commit, as the consumer's own session is relaxed on
-- Postgres directly (relax_commit, durable_acks): relax 'off' relaxes it, 'auto' unless
-- the server has synchronous standbys, NULL leaves it as the session says. The setting
-- lasts until this statement's transaction ends; wanted is read by every claim, so it
-- is made before the commit whatever the claim finds.
CASE %(relax)s::text
    WHEN 'off' THEN pg_catalog.set_config('synchronous_commit', 'off', true) IS NOT NULL
    WHEN 'auto' THEN
        CASE WHEN pg_catalog.current_setting('synchronous_standby_names') = ''
             THEN pg_catalog.set_config('synchronous_commit', 'off', true) IS NOT NULL
             ELSE true
        END
    ELSE true
END

-- part: claim_acks
-- The acks the claim carries, as rows: (id, lease, queue), each a fencing token.
ROWS FROM (pg_catalog.unnest(%(ack_ids)s::bigint[]),
           pg_catalog.unnest(%(ack_leases)s::integer[]),
           pg_catalog.unnest(%(ack_queues)s::text[])) AS a(id, lease, queue)

-- part: claim_ack
-- Ack: delete each message under its token (id, lease and queue): a holder whose lease
-- lapsed (the message was claimed again, or released) deletes nothing. An acked id is
-- never picked by this statement (claim_pick): an ack whose lease lapsed must not race
-- its own redelivery. Its okey tells claim_handoff which keys it ends.
DELETE FROM {schema}.message AS m
USING {part:claim_acks}
WHERE m.id = a.id AND m.lease = a.lease AND m.queue = a.queue
RETURNING m.id, m.queue, m.okey

-- part: claim_levels
-- The priorities present in each wanted queue, highest first: one index descent per
-- priority (a skip scan of message_claim_idx), whatever lies between them. A fair queue
-- is picked by claim_pick_fair instead.
WITH RECURSIVE level AS (
    SELECT w.name, (SELECT m.priority FROM {schema}.message AS m
                    WHERE m.queue = w.name ORDER BY m.priority DESC LIMIT 1) AS priority
    FROM wanted AS w
    WHERE NOT w.fair
    UNION ALL
    SELECT l.name, (SELECT m.priority FROM {schema}.message AS m
                    WHERE m.queue = l.name AND m.priority < l.priority
                    ORDER BY m.priority DESC LIMIT 1)
    FROM level AS l WHERE l.priority IS NOT NULL
)
SELECT name, priority FROM level WHERE priority IS NOT NULL

-- part: claim_pick
-- Pick: the first visible, unexpired rows of each queue and priority in claim order
-- (message_claim_idx from its ready end; a parked row, visible_at 'infinity', lies past
-- the index condition and is never read), each locked, at most per_queue of each: over
-- many queues a consumer asks a few of each (limit divided among them) rather than limit
-- of each, so a claim locks about limit rows whatever the number of queues. A short
-- answer then says which queues are empty: those that gave fewer than per_queue (held
-- rows counted). Locked FOR NO KEY UPDATE: a claim's update changes no key, and the
-- key-share locks of other claims' gates must not wait for it. octet_length of the text
-- reads the stored size, without detoasting.
SELECT c.id, c.priority, c.visible_at, c.read_ct, c.bytes, c.kind,
       wanted.vt, wanted.max_attempts, levels.name AS queue,
       c.okey, c.oseq, c.follows, c.follow_until, NULL::text AS fkey
FROM levels JOIN wanted ON wanted.name = levels.name
CROSS JOIN LATERAL (
    SELECT m.id, m.priority, m.visible_at, m.read_ct,
           pg_catalog.octet_length(m.payload::text) AS bytes,
           pg_catalog.json_typeof(m.payload) AS kind,
           m.okey, m.oseq, m.follows, m.follow_until
    FROM {schema}.message AS m
    WHERE m.queue = levels.name AND m.priority = levels.priority
      AND m.visible_at <= pg_catalog.now()
      AND (m.expires_at IS NULL OR m.expires_at > pg_catalog.now())
      AND m.id <> ALL(%(ack_ids)s::bigint[])
    ORDER BY m.visible_at, m.id
    LIMIT %(per_queue)s::integer
    FOR NO KEY UPDATE SKIP LOCKED
) AS c
ORDER BY c.priority DESC, c.visible_at, c.id
LIMIT %(limit)s::integer

-- part: claim_pick_fair
-- Pick of a fair queue (queue.fair; docs/design/flow-control.md, "Fair share"): its keys
-- (fkey; a message published without one has the key '') are walked in key order from
-- where the queue's last claim stopped (the key after fair_cursor.after; from the first
-- key when the queue has no cursor yet), wrapping once: one descent of
-- message_fair_idx per key (a skip scan), at most 4 x per_queue keys, until per_queue keys
-- with a ready message were found. Each such key gives up to its share of per_queue
-- (per_queue divided among them, rounded up), its oldest ready rows first, locked as
-- claim_pick locks; then the rows are taken turn by turn (every key's first, then every
-- key's second, ...), in walk order within a turn, up to per_queue. So a key with a lone
-- message waits at most for the claims that serve the keys walked before it, however many
-- messages another key holds. Invariant: a key is served by a claim only if every key
-- between the cursor and it (in walk order) was served or had nothing ready.
SELECT r.id, r.priority, r.visible_at, r.read_ct, r.bytes, r.kind, r.vt, r.max_attempts,
       r.queue, r.okey, r.oseq, r.follows, r.follow_until, r.fkey
FROM (
  SELECT t.*, pg_catalog.row_number() OVER (PARTITION BY t.queue ORDER BY t.turn, t.n)
                  AS place
  FROM (
    SELECT c.*, k.queue, k.fkey, k.n, wanted.vt, wanted.max_attempts,
           pg_catalog.row_number() OVER (
               PARTITION BY k.queue, k.fkey ORDER BY c.visible_at, c.id) AS turn
    FROM (
        SELECT f.*, pg_catalog.ceil(%(per_queue)s::numeric
                                    / pg_catalog.count(*) OVER (PARTITION BY f.queue))::integer
                    AS share
        FROM (
            WITH RECURSIVE walk AS (
                SELECT b.queue, b.after, b.first, b.fkey, b.wrapped, 1 AS n,
                       r.ready, r.ready::integer AS found
                FROM (
                    SELECT w.name AS queue, a.after, a.first,
                           COALESCE(a.next, a.first) AS fkey, a.next IS NULL AS wrapped
                    FROM wanted AS w
                    CROSS JOIN LATERAL (
                        SELECT c.after,
                               (SELECT m.fkey FROM {schema}.message AS m
                                WHERE m.queue = w.name AND m.fkey > c.after
                                ORDER BY m.fkey LIMIT 1) AS next,
                               (SELECT m.fkey FROM {schema}.message AS m
                                WHERE m.queue = w.name AND m.fkey >= ''
                                ORDER BY m.fkey LIMIT 1) AS first
                        FROM (SELECT (SELECT fc.after FROM {schema}.fair_cursor AS fc
                                      WHERE fc.queue = w.name) AS after) AS c
                    ) AS a
                    WHERE w.fair
                ) AS b
                CROSS JOIN LATERAL (SELECT {part:claim_fair_ready} AS ready) AS r
                UNION ALL
                SELECT k.queue, k.after, k.first, b.fkey, b.wrapped, k.n + 1,
                       r.ready, k.found + r.ready::integer
                FROM walk AS k
                CROSS JOIN LATERAL (
                    SELECT COALESCE(x.next, CASE WHEN NOT k.wrapped THEN k.first END) AS fkey,
                           k.wrapped OR x.next IS NULL AS wrapped, k.queue AS queue
                    FROM (SELECT (SELECT m.fkey FROM {schema}.message AS m
                                  WHERE m.queue = k.queue AND m.fkey > k.fkey
                                  ORDER BY m.fkey LIMIT 1) AS next) AS x
                ) AS b
                CROSS JOIN LATERAL (SELECT {part:claim_fair_ready} AS ready) AS r
                WHERE k.fkey IS NOT NULL AND NOT (k.wrapped AND COALESCE(k.fkey > k.after, false))
                  AND k.n < 4 * %(per_queue)s::integer AND k.found < %(per_queue)s::integer
            )
            SELECT walk.queue, walk.fkey, walk.n FROM walk
            WHERE walk.ready AND NOT (walk.wrapped AND COALESCE(walk.fkey > walk.after, false))
        ) AS f
    ) AS k
    JOIN wanted ON wanted.name = k.queue
    CROSS JOIN LATERAL (
        SELECT m.id, m.priority, m.visible_at, m.read_ct,
               pg_catalog.octet_length(m.payload::text) AS bytes,
               pg_catalog.json_typeof(m.payload) AS kind,
               m.okey, m.oseq, m.follows, m.follow_until
        FROM {schema}.message AS m
        WHERE m.queue = k.queue AND m.fkey = k.fkey
          AND m.visible_at <= pg_catalog.now()
          AND (m.expires_at IS NULL OR m.expires_at > pg_catalog.now())
          AND m.id <> ALL(%(ack_ids)s::bigint[])
        ORDER BY m.visible_at, m.id
        LIMIT k.share
        FOR NO KEY UPDATE SKIP LOCKED
    ) AS c
  ) AS t
) AS r
WHERE r.place <= %(per_queue)s::integer

-- part: claim_fair_ready
-- Whether key b.fkey of fair queue b.queue has a ready message: its first entry in
-- message_fair_idx is one (ready rows sort before those in flight or delayed).
b.fkey IS NOT NULL AND (SELECT m.visible_at <= pg_catalog.now() FROM {schema}.message AS m
                        WHERE m.queue = b.queue AND m.fkey = b.fkey
                        ORDER BY m.visible_at, m.id LIMIT 1)

-- part: claim_fair_served
-- Per fair queue this claim picked from: the last key it served in walk order (the
-- greatest key at or before the cursor when the walk wrapped, else the greatest), and
-- whether the queue has a cursor row yet.
SELECT c.queue,
       COALESCE(pg_catalog.max(c.fkey) FILTER (WHERE c.fkey <= p.after),
                pg_catalog.max(c.fkey)) AS last,
       p.known
FROM candidates AS c
CROSS JOIN LATERAL (
    SELECT fc.after, fc.queue IS NOT NULL AS known
    FROM (SELECT 1) AS one
    LEFT JOIN {schema}.fair_cursor AS fc ON fc.queue = c.queue
) AS p
WHERE c.fkey IS NOT NULL
GROUP BY c.queue, p.known

-- part: claim_fair_move
-- Move each fair queue's cursor to the last key served, through a SKIP LOCKED lock: a
-- claim never waits for another's cursor move (two claims at once may serve the same
-- keys, never the same row).
UPDATE {schema}.fair_cursor AS f
SET after = s.last
FROM fair_served AS s
WHERE f.queue = s.queue
  AND f.queue = ANY(ARRAY(SELECT fc.queue FROM {schema}.fair_cursor AS fc
                          WHERE fc.queue = ANY(ARRAY(SELECT s2.queue FROM fair_served AS s2))
                          FOR UPDATE SKIP LOCKED))

-- part: claim_gate_key
-- Gate (ordering key, migrations 0011-0012): never two messages of one key at once,
-- and a key's messages in their order (oseq, id). NULL lets the candidate c through;
-- 'park' parks it until an earlier message leaves (the trigger message_leave promotes
-- it), 'wait' until the lease of the one in flight ends, 'busy' holds it back for this
-- claim only. Every lock is SKIP LOCKED: a claim never waits. docs/design/ordering.md
-- has the argument for each branch.
CASE WHEN c.okey IS NULL THEN NULL
     -- An earlier message of its key is there (message_key_idx): parked behind it under
     -- a key-share lock, which that message's removal must wait for, so its trigger sees
     -- the park. One locked by its removal right now: busy.
     WHEN (SELECT 1 FROM {schema}.message AS p
           WHERE {part:claim_key_earlier} LIMIT 1) IS NOT NULL
     THEN CASE WHEN EXISTS (SELECT 1 FROM {schema}.message AS p
                            WHERE {part:claim_key_earlier}
                            FOR KEY SHARE OF p SKIP LOCKED) THEN 'park'
               ELSE 'busy' END
     -- First of its key, and no other message of the key live (message_key_live_idx)
     -- but those this claim holds: through (the common case, one probe).
     WHEN (SELECT 1 FROM {schema}.message AS p
           WHERE {part:claim_key_others}
             AND p.id <> ALL(ARRAY(SELECT id FROM candidates)) LIMIT 1) IS NULL
     THEN NULL
     -- One is in flight (delivered while this one, placed before it, was not committed
     -- yet): wait, parked until its lease ends; busy if it cannot be locked.
     WHEN EXISTS (SELECT 1 FROM {schema}.message AS p
                  WHERE {part:claim_key_others} AND {part:claim_key_in_flight}
                  FOR KEY SHARE OF p SKIP LOCKED) THEN 'wait'
     WHEN (SELECT 1 FROM {schema}.message AS p
           WHERE {part:claim_key_others} AND {part:claim_key_in_flight} LIMIT 1)
          IS NOT NULL
     THEN 'busy'
     -- The others are ready or due later: none may be taken by another claim now, nor
     -- have been since this statement began (each is locked here, as it stands now).
     -- One that cannot be locked, or has changed, makes the key busy for this claim.
     WHEN (SELECT pg_catalog.count(*) FROM {schema}.message AS p
           WHERE {part:claim_key_others}
             AND p.id <> ALL(ARRAY(SELECT id FROM candidates)))
          = (SELECT pg_catalog.count(*) FROM (
                 SELECT 1 FROM {schema}.message AS p
                 WHERE {part:claim_key_others}
                   AND p.id <> ALL(ARRAY(SELECT id FROM candidates))
                   AND NOT ({part:claim_key_in_flight})
                 FOR SHARE OF p SKIP LOCKED) AS l)
     THEN NULL
     ELSE 'busy'
END

-- part: claim_key_earlier
-- A message p of candidate c's key placed before it, and not acked by this statement
-- (a message whose only earlier ones are acked here goes).
p.queue = c.queue AND p.okey = c.okey
AND (p.oseq, p.id) < (c.oseq, c.id)
AND p.id <> ALL(ARRAY(SELECT id FROM acked))

-- part: claim_key_others
-- Another live (not parked) message p of candidate c's key, not acked by this statement.
p.queue = c.queue AND p.okey = c.okey
AND p.visible_at < 'infinity'::timestamptz AND p.id <> c.id
AND p.id <> ALL(ARRAY(SELECT id FROM acked))

-- part: claim_key_in_flight
-- Message p is delivered and its lease runs (not due later, not parked).
p.read_ct > 0 AND p.visible_at > pg_catalog.now() AND p.due_at IS NULL

-- part: claim_gate_follows
-- Gate (follows): a follower is delivered once the task it follows has ended (its
-- follow_done row: 'seen'), or, past follow_until, with the note follows-missing. While
-- that task's message is there the follower is parked until follow_until under a
-- key-share lock on it (its removal waits for the lock, then promotes the follower); a
-- message locked by its removal right now: busy. Nothing of it there and no end
-- recorded (not published yet): parked.
CASE WHEN c.follows IS NULL THEN NULL
     WHEN (SELECT 1 FROM {schema}.follow_done AS d
           WHERE d.task_id = c.follows LIMIT 1) IS NOT NULL
     THEN 'seen'
     WHEN c.follow_until <= pg_catalog.now() THEN 'missing'
     WHEN EXISTS (SELECT 1 FROM {schema}.message AS x
                  WHERE x.task_id = c.follows
                  FOR KEY SHARE OF x SKIP LOCKED) THEN 'park'
     WHEN (SELECT 1 FROM {schema}.message AS x
           WHERE x.task_id = c.follows LIMIT 1) IS NOT NULL
     THEN 'busy'
     ELSE 'park'
END

-- part: claim_hold
-- What a gate stopped: held back (returned with the note held, never delivered), and
-- parked until park_until when the gate says so ('busy': not parked, the next claim
-- looks again). The key gate decides first.
SELECT g.id, g.queue, g.priority, g.read_ct, g.visible_at,
       CASE WHEN g.key_gate = 'park' THEN 'infinity'::timestamptz
            WHEN g.key_gate = 'wait'
            THEN (SELECT pg_catalog.min(p.visible_at) FROM {schema}.message AS p
                  WHERE p.queue = g.queue AND p.okey = g.okey
                    AND p.visible_at < 'infinity'::timestamptz AND p.id <> g.id
                    AND {part:claim_key_in_flight})
            WHEN g.key_gate IS NULL AND g.follow_gate = 'park' THEN g.follow_until
       END AS park_until
FROM gated AS g
WHERE g.key_gate IS NOT NULL OR g.follow_gate IN ('park', 'busy')

-- part: claim_park
-- Park: out of the claim index's ready range (visible_at 'infinity' sorts after every
-- ready row) or until a time, the time it was due kept in due_at for its promotion.
UPDATE {schema}.message AS t
SET due_at = t.visible_at,
    visible_at = (SELECT held.park_until FROM held WHERE held.id = t.id)
WHERE t.id = ANY(ARRAY(SELECT id FROM held WHERE park_until IS NOT NULL))

-- part: claim_handoff
-- Hand-off: the next message of each ordering key an ack here ends, when it is parked:
-- this statement claims it (the key's next message costs no second round trip; the
-- ack's trigger then finds it taken). Looked up in this statement's snapshot, where the
-- acked rows still are: a park committed after it began is the trigger's to promote.
-- Only one plainly deliverable passes: due, not expired (as claim_pick), no follows
-- link, within max_attempts and max_message_bytes, a JSON object, and no flow limit
-- defined at all (the flow gates judge what is picked, not what is handed); anything else
-- waits for the trigger (an expired one then for housekeeping, maintain, whose removal of
-- it releases the key). It is not locked here: claim_update takes it only if it is still
-- parked once locked.
SELECT n.id, n.priority, n.due_at AS visible_at, n.read_ct, n.bytes, n.kind,
       wanted.vt, wanted.max_attempts
FROM (SELECT DISTINCT a.queue, a.okey FROM acked AS a WHERE a.okey IS NOT NULL) AS k
JOIN wanted ON wanted.name = k.queue
CROSS JOIN LATERAL (
    SELECT h.id, h.priority, h.due_at, h.read_ct, h.visible_at, h.follows, h.expires_at,
           pg_catalog.octet_length(h.payload::text) AS bytes,
           pg_catalog.json_typeof(h.payload) AS kind
    FROM {schema}.message AS h
    WHERE h.queue = k.queue AND h.okey = k.okey AND h.id <> ALL(%(ack_ids)s::bigint[])
    ORDER BY h.oseq, h.id
    LIMIT 1
) AS n
WHERE n.visible_at = 'infinity'::timestamptz AND n.follows IS NULL
  AND n.due_at <= pg_catalog.now()
  AND (n.expires_at IS NULL OR n.expires_at > pg_catalog.now())
  AND n.read_ct < wanted.max_attempts
  AND n.bytes <= %(max_message_bytes)s::bigint AND n.kind = 'object'
  AND {part:claim_flow_on} IS NULL

-- part: claim_budget
-- Budget: what the gates let through and the hand-off, in claim order, within limit
-- and max_bytes (the first message always; an oversized payload takes no room, it is
-- never sent), each with its doom (claim_doom) and note.
SELECT s.id, s.priority, s.visible_at, s.read_ct, s.vt, s.oversize,
       {part:claim_doom} AS doom,
       CASE WHEN s.follow_gate = 'missing' THEN 'follows-missing' END AS note
FROM (
    SELECT c.*, pg_catalog.sum(CASE WHEN c.oversize THEN 0 ELSE c.bytes END) OVER (
               ORDER BY c.priority DESC, c.visible_at, c.id)
           - CASE WHEN c.oversize THEN 0 ELSE c.bytes END AS before,
           pg_catalog.row_number() OVER (ORDER BY c.priority DESC, c.visible_at, c.id)
               AS rank
    FROM (SELECT u.*, u.bytes > %(max_message_bytes)s::bigint AS oversize
          FROM (SELECT g.id, g.priority, g.visible_at, g.read_ct, g.bytes, g.kind, g.vt,
                       g.max_attempts, g.follow_gate
                FROM gated AS g
                WHERE g.key_gate IS NULL
                  AND (g.follow_gate IS NULL OR g.follow_gate IN ('seen', 'missing'))
                UNION ALL
                SELECT h.id, h.priority, h.visible_at, h.read_ct, h.bytes, h.kind, h.vt,
                       h.max_attempts, NULL
                FROM handed AS h) AS u)
        AS c
) AS s
WHERE (s.before = 0 OR s.before < %(max_bytes)s::bigint) AND s.rank <= %(limit)s::integer

-- part: claim_flow_on
-- Whether any flow limit is defined (one probe of an empty table otherwise). Every read
-- of the flow gates' parts is guarded by it, so that without limits none of them runs:
-- a queue that uses none of this pays these probes only.
(SELECT true FROM {schema}.flow_limit LIMIT 1)

-- part: claim_flow_meets
-- What each message picked for delivery (not doomed: dead-lettering never waits for a
-- token or a slot) asks of the flow limits, read from its headers: its task, its rate
-- limiter and key (pgq-rate-limiter, default task:<task>; pgq-rate-key) and its
-- concurrency limiter and key (pgq-concurrency-limiter, default task:<task>;
-- pgq-concurrency-key). A key over 512 bytes is replaced by its digest (an index entry
-- has a size limit; equal keys stay equal). Nothing at all, one probe, when no limit is
-- defined: a queue that uses none of this pays that probe only.
SELECT g.id, g.queue, g.priority, g.visible_at, g.read_ct, g.vt, h.task,
       COALESCE(h.headers ->> 'pgq-rate-limiter', 'task:' || h.task) AS rlimit,
       CASE WHEN pg_catalog.octet_length(h.headers ->> 'pgq-rate-key') > 512
            THEN 'md5:' || pg_catalog.md5(h.headers ->> 'pgq-rate-key')
            ELSE h.headers ->> 'pgq-rate-key' END AS rkey,
       COALESCE(h.headers ->> 'pgq-concurrency-limiter', 'task:' || h.task) AS climit,
       CASE WHEN pg_catalog.octet_length(h.headers ->> 'pgq-concurrency-key') > 512
            THEN 'md5:' || pg_catalog.md5(h.headers ->> 'pgq-concurrency-key')
            ELSE h.headers ->> 'pgq-concurrency-key' END AS ckey
FROM picked AS s
JOIN gated AS g ON g.id = s.id
CROSS JOIN LATERAL (
    SELECT m.payload -> 'headers' AS headers, m.payload -> 'headers' ->> 'task' AS task
    FROM {schema}.message AS m WHERE m.id = g.id
) AS h
WHERE s.doom IS NULL AND {part:claim_flow_on}

-- part: claim_gate_slots
-- Gate (concurrency per key): per key with a concurrency limit, how many of its
-- candidates may start (flow_slots: counted under the key's row lock, in a fresh
-- snapshot; -1: busy) and the earliest lease end of its holders. Keys in one order.
SELECT k.climit, k.ckey, s.granted, s.next_at
FROM (SELECT f.climit, f.ckey, pg_catalog.count(*)::integer AS want
      FROM flow_meets AS f
      WHERE f.ckey IS NOT NULL
        AND (SELECT l.concurrency FROM {schema}.flow_limit AS l WHERE l.name = f.climit)
            IS NOT NULL
      GROUP BY f.climit, f.ckey
      ORDER BY f.climit, f.ckey) AS k
CROSS JOIN LATERAL {schema}.flow_slots(k.climit, k.ckey, k.want) AS s

-- part: claim_slots
-- Each candidate's slot: NULL (no concurrency limit), 'slot' (within what its key
-- grants, in claim order), 'full' (parked until slot_until: the earliest lease end of
-- the key's holders, this claim's own grants included), 'busy' (held, not parked).
SELECT f.*,
       CASE WHEN s.granted IS NULL THEN NULL
            WHEN s.granted < 0 THEN 'busy'
            WHEN pg_catalog.row_number() OVER (
                     PARTITION BY f.climit, f.ckey
                     ORDER BY f.priority DESC, f.visible_at, f.id) <= s.granted
            THEN 'slot'
            ELSE 'full'
       END AS slot_gate,
       LEAST(s.next_at, pg_catalog.now() + pg_catalog.make_interval(secs => f.vt))
           AS slot_until
FROM flow_meets AS f
LEFT JOIN slots AS s ON s.climit = f.climit AND s.ckey = f.ckey

-- part: claim_gate_queue
-- Gate (a queue's own concurrency, limit queue:<name>): per queue with one, how many of
-- its candidates the key gate let through may start (flow_queue_slots: counted under
-- the queue's row lock, in a fresh snapshot; -1: busy) and the earliest lease end of
-- its holders. Queues in one order.
SELECT q.queue, s.granted, s.next_at
FROM (SELECT f.queue, pg_catalog.count(*)::integer AS want
      FROM slotted AS f
      WHERE (f.slot_gate IS NULL OR f.slot_gate = 'slot')
        AND (SELECT l.concurrency FROM {schema}.flow_limit AS l
             WHERE l.name = 'queue:' || f.queue) IS NOT NULL
      GROUP BY f.queue
      ORDER BY f.queue) AS q
CROSS JOIN LATERAL {schema}.flow_queue_slots(q.queue, q.want) AS s

-- part: claim_queue_slots
-- Each candidate's queue slot: NULL (no queue concurrency, or its key's gate stopped
-- it), 'slot' (within what its queue grants, in claim order), 'full' (parked until
-- queue_until: the earliest lease end of the queue's holders, this claim's own grants
-- included), 'busy' (held, not parked).
SELECT e.*,
       CASE WHEN NOT e.queue_eligible THEN NULL
            WHEN e.queue_granted < 0 THEN 'busy'
            WHEN pg_catalog.row_number() OVER (
                     PARTITION BY e.queue, e.queue_eligible
                     ORDER BY e.priority DESC, e.visible_at, e.id) <= e.queue_granted
            THEN 'slot'
            ELSE 'full'
       END AS queue_gate
FROM (SELECT f.*, q.granted AS queue_granted,
             q.granted IS NOT NULL
                 AND COALESCE(f.slot_gate NOT IN ('full', 'busy'), true) AS queue_eligible,
             LEAST(q.next_at, pg_catalog.now() + pg_catalog.make_interval(secs => f.vt))
                 AS queue_until
      FROM slotted AS f
      LEFT JOIN qslots AS q ON q.queue = f.queue) AS e

-- part: claim_flow_wants
-- The rate buckets each candidate its slot let through meets (all must grant): its
-- queue's (queue:<queue>), its task's (task:<task>) unless its rate key is of the task's
-- own limiter, and its rate key's; only those with a rate defined. Ranked in claim order
-- within each bucket.
SELECT f.id, b.limiter, b.key,
       pg_catalog.row_number() OVER (PARTITION BY b.limiter, b.key
                                     ORDER BY f.priority DESC, f.visible_at, f.id) AS rank
FROM qslotted AS f
CROSS JOIN LATERAL (
    SELECT DISTINCT v.limiter, v.key
    FROM (VALUES ('queue:' || f.queue, ''),
                 (CASE WHEN f.rkey IS NULL OR f.rlimit <> 'task:' || f.task
                       THEN 'task:' || f.task END, ''),
                 (CASE WHEN f.rkey IS NOT NULL THEN f.rlimit END, f.rkey)) AS v(limiter, key)
    WHERE v.limiter IS NOT NULL
) AS b
WHERE (f.slot_gate IS NULL OR f.slot_gate = 'slot')
  AND (f.queue_gate IS NULL OR f.queue_gate = 'slot')
  AND (SELECT l.rate_count FROM {schema}.flow_limit AS l WHERE l.name = b.limiter)
      IS NOT NULL

-- part: claim_gate_rate
-- Gate (rate, GCRA): per bucket the candidates meet, how many it grants now, when its
-- next token is due and the interval between tokens (flow_tokens, under the bucket's
-- row lock; -1: busy). A token one bucket grants to a candidate another refuses is
-- spent unused: never over a limit, at worst under it within one claim.
SELECT b.limiter, b.key, t.granted, t.next_at, t.step
FROM (SELECT w.limiter, w.key, pg_catalog.count(*)::integer AS want
      FROM flow_wants AS w
      GROUP BY w.limiter, w.key
      ORDER BY w.limiter, w.key) AS b
CROSS JOIN LATERAL {schema}.flow_tokens(b.limiter, b.key, b.want) AS t

-- part: claim_flow_hold
-- What the flow gates stopped: held back (note held), and parked until park_until: a
-- key with no free slot until its holders' earliest lease end (a holder's removal
-- promotes the earliest waiting one before that: flow_leave); a bucket out of tokens,
-- the i-th refused candidate until the bucket's next token plus i intervals, the latest
-- of its buckets. Busy (a key or bucket another claim holds): held, not parked.
SELECT f.id, f.queue, f.priority, f.read_ct, f.visible_at,
       CASE WHEN f.slot_gate IS NOT NULL THEN f.climit END AS climit,
       CASE WHEN f.slot_gate IS NOT NULL THEN f.ckey END AS ckey,
       f.queue_gate IS NOT NULL AS qslot,
       CASE WHEN f.slot_gate = 'full' THEN f.slot_until
            WHEN f.slot_gate = 'busy' THEN NULL
            WHEN f.queue_gate = 'full' THEN f.queue_until
            WHEN f.queue_gate = 'busy' THEN NULL
            ELSE r.until
       END AS park_until
FROM qslotted AS f
LEFT JOIN LATERAL (
    SELECT pg_catalog.max(t.next_at + pg_catalog.make_interval(
               secs => (w.rank - t.granted - 1) * t.step))
               FILTER (WHERE t.granted >= 0 AND w.rank > t.granted) AS until,
           pg_catalog.bool_or(t.granted < 0) AS busy
    FROM flow_wants AS w
    JOIN rate AS t ON t.limiter = w.limiter AND t.key = w.key
    WHERE w.id = f.id
) AS r ON true
WHERE f.slot_gate IN ('full', 'busy') OR f.queue_gate IN ('full', 'busy')
   OR r.until IS NOT NULL OR r.busy

-- part: claim_flow_park
-- Park what the flow gates stopped until its time (what next_due reports, so an idle
-- consumer's timer fires then: no polling), its place kept in due_at (which also says
-- it holds no slot), and the key of its slot written for flow_leave to find it.
UPDATE {schema}.message AS t
SET due_at = COALESCE(t.due_at, t.visible_at),
    visible_at = (SELECT f.park_until FROM flow_held AS f WHERE f.id = t.id),
    climit = COALESCE((SELECT f.climit FROM flow_held AS f WHERE f.id = t.id), t.climit),
    ckey = COALESCE((SELECT f.ckey FROM flow_held AS f WHERE f.id = t.id), t.ckey),
    qslot = t.qslot OR COALESCE((SELECT f.qslot FROM flow_held AS f WHERE f.id = t.id), false)
WHERE t.id = ANY(ARRAY(SELECT id FROM flow_held
                       WHERE park_until IS NOT NULL AND {part:claim_flow_on}))

-- part: claim_doom
-- Doom: why message s must not be delivered, if it must not: a payload larger than
-- max_message_bytes or not a JSON object, or a next delivery past its queue's
-- max_attempts. A doomed message is moved to dead_letter by this statement
-- (claim_dead), with the reason: never delivered (again), never lost.
CASE WHEN s.oversize
     THEN pg_catalog.format('payload of %%s bytes exceeds max_message_bytes %%s',
                            s.bytes, %(max_message_bytes)s::bigint)
     WHEN s.kind IS DISTINCT FROM 'object'
     THEN pg_catalog.format('payload is a JSON %%s, not an object', s.kind)
     WHEN s.read_ct >= s.max_attempts
     THEN pg_catalog.format('delivered %%s times; max_attempts is %%s',
                            s.read_ct, s.max_attempts)
END

-- part: claim_dead
-- The doomed rows leave message (and go to dead_letter, the CTE dead beside it) in the
-- same statement.
DELETE FROM {schema}.message AS t
WHERE t.id = ANY(ARRAY(SELECT id FROM picked WHERE doom IS NOT NULL))
RETURNING t.id, t.queue, t.priority, t.read_ct, t.lease, t.enqueued_at, t.payload

-- part: claim_dead_letter
-- The doomed rows' dead letters, each with its doom as the reason (the CTEs poisoned,
-- claim_dead, and picked beside it).
INSERT INTO {schema}.dead_letter
    (message_id, queue, priority, read_ct, enqueued_at, reason, payload)
SELECT p.id, p.queue, p.priority, p.read_ct, p.enqueued_at, picked.doom, p.payload
FROM poisoned AS p JOIN picked ON picked.id = p.id
RETURNING id, message_id

-- part: claim_update
-- Update: each row picked and not doomed is leased for its queue's vt under a new grant
-- (claim_lease). A handed row was not locked before: taken only if still parked once it
-- is (claim_leased).
UPDATE {schema}.message AS t
SET {part:claim_lease}
WHERE {part:claim_leased}
RETURNING t.id, t.queue, t.priority, t.read_ct, t.lease, t.payload

-- part: claim_flow_update
-- Update past the flow gates: claim_update, but a row a flow limit held is not leased,
-- and a slot granted is written on the row it is granted to (climit, ckey), which is
-- what counts it in flight.
UPDATE {schema}.message AS t
SET {part:claim_lease},
    climit = CASE WHEN {part:claim_flow_on}
                  THEN COALESCE((SELECT f.climit FROM slotted AS f
                                 WHERE f.id = t.id AND f.slot_gate = 'slot'), t.climit)
                  ELSE t.climit END,
    ckey = CASE WHEN {part:claim_flow_on}
                THEN COALESCE((SELECT f.ckey FROM slotted AS f
                               WHERE f.id = t.id AND f.slot_gate = 'slot'), t.ckey)
                ELSE t.ckey END,
    qslot = CASE WHEN {part:claim_flow_on}
                 THEN t.qslot OR EXISTS (SELECT FROM qslotted AS f
                                         WHERE f.id = t.id AND f.queue_gate = 'slot')
                 ELSE t.qslot END
WHERE {part:claim_leased}
  AND t.id <> ALL(ARRAY(SELECT id FROM flow_held WHERE {part:claim_flow_on}))
RETURNING t.id, t.queue, t.priority, t.read_ct, t.lease, t.payload

-- part: claim_lease
-- The lease (in an UPDATE of message t): visible again after its queue's vt, one
-- delivery more, a new grant (lease + 1, the fencing token its ack, release and renewal
-- must show), no longer parked.
visible_at = pg_catalog.now() + pg_catalog.make_interval(secs => (
        SELECT picked.vt FROM picked WHERE picked.id = t.id)),
    read_ct = t.read_ct + 1,
    lease = t.lease + 1,
    due_at = NULL,
    -- unique_while="queued": delivered, it no longer holds its key (a plain message's
    -- stays NULL: no index entry, the update stays HOT).
    ukey = CASE WHEN t.urun THEN t.ukey END

-- part: claim_leased
-- Which rows of message t are leased: picked and not doomed; a handed row only if it is
-- still parked once locked.
t.id = ANY(ARRAY(SELECT id FROM picked WHERE doom IS NULL))
  AND (t.visible_at = 'infinity'::timestamptz
       OR NOT t.id = ANY(ARRAY(SELECT id FROM handed)))

-- part: claim_flow_stopped
-- What the gates held back (held) and what the flow limits held (flow_held), for the
-- answer (claim_answer's stopped).
SELECT id, queue, priority, read_ct, visible_at FROM held
UNION ALL
SELECT id, queue, priority, read_ct, visible_at FROM flow_held WHERE {part:claim_flow_on}

-- part: claim_delivered
-- What comes back as delivered: leased rows, and dead-lettered ones with their
-- dead_letter id.
SELECT id, queue, priority, read_ct, lease, payload, NULL::bigint AS dead_letter_id
FROM claimed
UNION ALL
SELECT p.id, p.queue, p.priority, p.read_ct, p.lease, p.payload, d.id
FROM poisoned AS p JOIN dead AS d ON d.message_id = p.id

-- part: claim_answer
-- The answer, in five parts: delivered in claim order (an oversized payload not sent),
-- held (stopped: what the statement's gates held back), then the acks that deleted
-- nothing: refused by the fencing (the lease lapsed and the message was claimed again,
-- or released), the row claim_limits when a flow limit exists, and last the row
-- claim_featured when the claim met a message the gates judge.
SELECT r.id, r.queue, r.priority, r.read_ct, r.lease, r.payload, r.dead_letter_id, r.doom,
       r.note
FROM (
    SELECT delivered.id, delivered.queue, delivered.priority, delivered.read_ct,
           delivered.lease,
           CASE WHEN picked.oversize THEN NULL ELSE delivered.payload END AS payload,
           delivered.dead_letter_id, picked.doom, picked.note,
           0 AS part, picked.visible_at
    FROM delivered JOIN picked ON picked.id = delivered.id
    UNION ALL
    SELECT h.id, h.queue, h.priority, h.read_ct, 0, NULL::json, NULL::bigint,
           NULL::text, 'held', 1, h.visible_at
    FROM stopped AS h
    UNION ALL
    SELECT a.id, a.queue, 0, 0, a.lease, NULL::json, NULL::bigint, NULL::text, 'refused',
           2, NULL::timestamptz
    FROM {part:claim_acks}
    WHERE a.id <> ALL(ARRAY(SELECT id FROM acked))
    UNION ALL
    {part:claim_limits}
    UNION ALL
    {part:claim_featured}
) AS r
ORDER BY r.part, r.priority DESC, r.visible_at, r.id

-- part: claim_limits
-- The answer's last row, note limits, when any flow limit exists (in this statement's
-- snapshot): the plain claim then picked nothing and the caller sends flow_claim; the
-- flow claim's answer without it says the caller may go back to claim. Not a message:
-- id 0, no payload.
SELECT 0::bigint, ''::text, 0, 0, 0, NULL::json, NULL::bigint, NULL::text, 'limits', 3,
       NULL::timestamptz
WHERE {part:claim_flow_on}

-- part: claim_plain
-- Candidate c is plain: no ordering key, no follows link. claim_gate_key and
-- claim_gate_follows let such a candidate through on their first branch, reading
-- nothing; both columns are set when the message is published and never change, and
-- they are read from the row as locked. So lean_claim delivering a plain candidate is
-- what claim would do, whatever is published beside it at the same moment.
c.okey IS NULL AND c.follows IS NULL

-- part: claim_mixed
-- Whether a candidate is not plain (claim_plain); NULL if none. lean_claim then delivers
-- none of them, all come back held for claim: what it delivers is what claim would
-- deliver, in the same order (no plain message overtakes a keyed one of a higher
-- priority or an earlier place). Uncorrelated, so read once (an InitPlan) wherever used.
(SELECT true FROM candidates AS c WHERE NOT ({part:claim_plain}) LIMIT 1)

-- part: claim_featured
-- The answer's very last row, note featured, when this claim met a message the gates
-- must judge: a candidate that is not plain (claim_plain), or an ack of a message of an
-- ordering key (claim hands its key's next on). The caller sends claim next; without the
-- row, lean_claim. Not a message: id 0, no payload.
SELECT 0::bigint, ''::text, 0, 0, 0, NULL::json, NULL::bigint, NULL::text, 'featured', 4,
       NULL::timestamptz
WHERE {part:claim_mixed} OR (SELECT true FROM acked AS a WHERE a.okey IS NOT NULL LIMIT 1)

-- name: next_due
-- Seconds from now until the first message of the given queues that is not visible yet
-- (a delayed one, or one whose lease runs out) becomes visible; NULL when there is none.
-- An idle consumer arms a timer with it, to claim the moment the message is due. One
-- index descent per priority present in a queue, as in claim (a skip scan), then the
-- first visible_at past now at that priority, less since seconds: the time since the
-- consumer's last claim looked (0 when none looked just before). A message that fell
-- due after that claim looked and is not claimed yet comes back as due now (a negative
-- answer), where past now alone it would wait for the next poll; one the claim saw and
-- left (a flow limit) fell due before it looked, and does not.
WITH RECURSIVE level AS (
    SELECT w.name, (SELECT m.priority FROM {schema}.message AS m
                    WHERE m.queue = w.name ORDER BY m.priority DESC LIMIT 1) AS priority
    FROM pg_catalog.unnest(%(queues)s::text[]) AS w(name)
    UNION ALL
    SELECT l.name, (SELECT m.priority FROM {schema}.message AS m
                    WHERE m.queue = l.name AND m.priority < l.priority
                    ORDER BY m.priority DESC LIMIT 1)
    FROM level AS l WHERE l.priority IS NOT NULL
)
SELECT EXTRACT(EPOCH FROM pg_catalog.min(d.at) - pg_catalog.clock_timestamp())::float8
FROM level AS l
CROSS JOIN LATERAL (
    SELECT m.visible_at AS at FROM {schema}.message AS m
    WHERE m.queue = l.name AND m.priority = l.priority
      AND m.visible_at > pg_catalog.now() - pg_catalog.make_interval(secs => %(since)s::float8)
      AND m.visible_at < 'infinity'::timestamptz
    ORDER BY m.visible_at LIMIT 1
) AS d
WHERE l.priority IS NOT NULL

-- name: pop
-- Take and delete up to limit visible messages at once, for consumers that never ack
-- (no_ack), within max_bytes of payload (the first always). Rows come back in delivery
-- order; reached by primary key, as in claim. A payload larger than max_message_bytes
-- or not a JSON object is moved to dead_letter instead, with the reason.
-- A queue with a flow limit of its own (queue:<name>) is not popped: a pop deletes what
-- it takes, without the claim's gates, so it could honour neither a rate nor a slot. A
-- consumer without acks is refused such a queue when it starts (queue_limit); one that
-- consumed it before the limit was set gets nothing more from it, and the messages wait
-- for a consumer that acks.
WITH wanted AS (
    SELECT w.name FROM pg_catalog.unnest(%(queues)s::text[]) AS w(name)
    WHERE NOT EXISTS (SELECT FROM {schema}.flow_limit AS l WHERE l.name = 'queue:' || w.name)
), candidates AS MATERIALIZED (
    SELECT c.id, c.priority, c.visible_at,
           c.bytes > %(max_message_bytes)s::bigint AS oversize, c.bytes, c.kind
    FROM wanted
    CROSS JOIN LATERAL (
        SELECT m.id, m.priority, m.visible_at,
               pg_catalog.octet_length(m.payload::text) AS bytes,
               pg_catalog.json_typeof(m.payload) AS kind
        FROM {schema}.message AS m
        WHERE m.queue = wanted.name AND m.visible_at <= pg_catalog.now()
          AND (m.expires_at IS NULL OR m.expires_at > pg_catalog.now())
        ORDER BY m.priority DESC, m.visible_at, m.id
        LIMIT %(limit)s::integer
        FOR UPDATE SKIP LOCKED
    ) AS c
    ORDER BY c.priority DESC, c.visible_at, c.id
    LIMIT %(limit)s::integer
), picked AS MATERIALIZED (
    SELECT s.id, s.priority, s.visible_at, s.oversize,
           CASE WHEN s.oversize
                THEN pg_catalog.format('payload of %%s bytes exceeds max_message_bytes %%s',
                                       s.bytes, %(max_message_bytes)s::bigint)
                WHEN s.kind IS DISTINCT FROM 'object'
                THEN pg_catalog.format('payload is a JSON %%s, not an object', s.kind)
           END AS doom
    FROM (
        SELECT c.*, pg_catalog.sum(CASE WHEN c.oversize THEN 0 ELSE c.bytes END) OVER (
                   ORDER BY c.priority DESC, c.visible_at, c.id)
               - CASE WHEN c.oversize THEN 0 ELSE c.bytes END AS before
        FROM candidates AS c
    ) AS s
    WHERE s.before = 0 OR s.before < %(max_bytes)s::bigint
), popped AS (
    DELETE FROM {schema}.message AS t
    WHERE t.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING t.id, t.queue, t.priority, t.read_ct + 1 AS read_ct, t.lease, t.enqueued_at,
              t.payload
), dead AS (
    INSERT INTO {schema}.dead_letter
        (message_id, queue, priority, read_ct, enqueued_at, reason, payload)
    SELECT p.id, p.queue, p.priority, p.read_ct, p.enqueued_at, picked.doom, p.payload
    FROM popped AS p JOIN picked ON picked.id = p.id
    WHERE picked.doom IS NOT NULL
    RETURNING id, message_id
)
SELECT popped.id, popped.queue, popped.priority, popped.read_ct, popped.lease,
       CASE WHEN picked.oversize THEN NULL ELSE popped.payload::text END,
       dead.id, picked.doom
FROM popped JOIN picked ON picked.id = popped.id LEFT JOIN dead ON dead.message_id = popped.id
ORDER BY picked.priority DESC, picked.visible_at, picked.id

-- name: ack
-- Delete delivered messages, fenced by the lease each was granted with and its queue;
-- the ids deleted (an ack missing from them was refused: its lease had lapsed).
DELETE FROM {schema}.message AS m
USING ROWS FROM (pg_catalog.unnest(%(ids)s::bigint[]),
                 pg_catalog.unnest(%(leases)s::integer[]),
                 pg_catalog.unnest(%(queues)s::text[])) AS a(id, lease, queue)
WHERE m.id = a.id AND m.lease = a.lease AND m.queue = a.queue
RETURNING m.id

-- name: release
-- Make claimed messages visible again now (requeue), fenced by lease and queue, and
-- wake their queues' listeners. The release is a grant too (lease + 1): the holder that
-- released a message, or any earlier one, can no more ack, renew or release it. A
-- released message goes back to the place it had when it was published (visible since
-- enqueued_at), ahead of what arrived after it, as on AMQP brokers. A failed message
-- (failed: a reject with requeue, not a consumer handing back what it did not start) of
-- an ordering key in a relaxed queue goes to the back of its key instead (its trigger
-- promotes the next one).
WITH released AS (
    UPDATE {schema}.message AS m
    SET visible_at = LEAST(m.enqueued_at, pg_catalog.now()), lease = m.lease + 1,
        oseq = CASE WHEN %(failed)s::boolean AND m.okey IS NOT NULL
                     AND (SELECT q.ordering FROM {schema}.queue AS q WHERE q.name = m.queue)
                         = 'relaxed'
                    THEN pg_catalog.nextval('{schema}.message_oseq'::regclass)
                    ELSE m.oseq END
    FROM ROWS FROM (pg_catalog.unnest(%(ids)s::bigint[]),
                    pg_catalog.unnest(%(leases)s::integer[]),
                    pg_catalog.unnest(%(queues)s::text[])) AS a(id, lease, queue)
    WHERE m.id = a.id AND m.lease = a.lease AND m.queue = a.queue
    RETURNING m.queue
)
SELECT pg_catalog.pg_notify(
           %(channel_prefix)s::text || pg_catalog.md5(pg_catalog.convert_to(q.queue, 'UTF8')),
           '')
FROM (SELECT DISTINCT queue FROM released) AS q

-- name: renew
-- Extend the visibility timeout of messages this consumer still holds (lease, queue);
-- the ids still held (one missing was refused: its lease had lapsed). A row locked right
-- now is skipped, never waited for, and still counts as held: an atomic task's
-- transaction is completing it (docs/design/exactly-once.md, "Locks"); it is gone at
-- that commit, or the next renewal lands after a rollback. A message holding a
-- concurrency slot (climit, or its queue's: qslot) whose lease has lapsed is refused
-- too, locked or not: its slot may have been given to another message, which must not
-- share it with a worker that comes back.
WITH given AS (
    SELECT a.*
    FROM ROWS FROM (pg_catalog.unnest(%(ids)s::bigint[]),
                    pg_catalog.unnest(%(leases)s::integer[]),
                    pg_catalog.unnest(%(queues)s::text[]),
                    pg_catalog.unnest(%(vts)s::float8[])) AS a(id, lease, queue, vt)
), renewed AS (
    UPDATE {schema}.message AS m
    SET visible_at = pg_catalog.now() + pg_catalog.make_interval(secs => a.vt)
    FROM given AS a
    WHERE m.id = a.id AND m.lease = a.lease AND m.queue = a.queue
      AND ((m.climit IS NULL AND NOT m.qslot) OR m.visible_at > pg_catalog.now())
      AND m.id = ANY(ARRAY(SELECT x.id FROM {schema}.message AS x
                           WHERE x.id = ANY(%(ids)s::bigint[])
                           FOR NO KEY UPDATE SKIP LOCKED))
    RETURNING m.id
)
SELECT id FROM renewed
UNION
SELECT m.id FROM {schema}.message AS m JOIN given AS a
    ON m.id = a.id AND m.lease = a.lease AND m.queue = a.queue
WHERE (m.climit IS NULL AND NOT m.qslot) OR m.visible_at > pg_catalog.now()

-- name: settle
-- The worker's ack of an atomic task's delivery (docs/design/exactly-once.md, step 6).
-- The task's own transaction deleted the row under its fencing token when it committed:
-- then this finds nothing (the usual case, not a refusal). A row still there under the
-- lease was not completed (the run rolled back, its commit failed, its process was
-- killed): it is released now (lease + 1, visible at once) instead of after its vt. A
-- row locked right now is a completion still committing: left alone (it is gone or it
-- lapses), never waited for. The ids released.
WITH settled AS (
    UPDATE {schema}.message AS m
    SET visible_at = LEAST(m.enqueued_at, pg_catalog.now()), lease = m.lease + 1
    FROM ROWS FROM (pg_catalog.unnest(%(ids)s::bigint[]),
                    pg_catalog.unnest(%(leases)s::integer[]),
                    pg_catalog.unnest(%(queues)s::text[])) AS a(id, lease, queue)
    WHERE m.id = a.id AND m.lease = a.lease AND m.queue = a.queue
      AND m.id = ANY(ARRAY(SELECT x.id FROM {schema}.message AS x
                           WHERE x.id = ANY(%(ids)s::bigint[])
                           FOR NO KEY UPDATE SKIP LOCKED))
    RETURNING m.id, m.queue
)
-- (one notification a queue: Postgres folds equal ones of a transaction)
SELECT s.id, pg_catalog.pg_notify(
           %(channel_prefix)s::text || pg_catalog.md5(pg_catalog.convert_to(s.queue, 'UTF8')),
           '')
FROM settled AS s

-- name: dead_letter
-- Move one claimed message to dead_letter with a reason, fenced by lease and queue.
WITH moved AS (
    DELETE FROM {schema}.message
    WHERE id = %(id)s::bigint AND lease = %(lease)s::integer AND queue = %(queue)s::text
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

-- name: dead_letter_envelope
-- A dead-lettered message's envelope without its body (the claim dead-letters an
-- oversized message unread): headers, properties, content type, as JSON text.
SELECT pg_catalog.json_build_object(
    'headers', payload -> 'headers',
    'properties', payload -> 'properties',
    'content-type', payload -> 'content-type')::text
FROM {schema}.dead_letter
WHERE id = %(id)s AND pg_catalog.json_typeof(payload) = 'object'

-- name: dead_letter_hooks
-- Record the outcome of every message_poisoned handler for a dead-letter row.
UPDATE {schema}.dead_letter SET hooks = %(hooks)s WHERE id = %(id)s

-- name: dead_letter_get
-- One dead-letter row.
SELECT id, message_id, queue, priority, read_ct, enqueued_at, dead_at, reason, task_id,
       task_name, identity, hooks, payload
FROM {schema}.dead_letter WHERE id = %(id)s

-- name: size
-- Count the messages of a queue that are ready for delivery now (expired ones are not),
-- and those waiting for their turn in an ordering key (parked).
SELECT pg_catalog.count(*) FROM {schema}.message
WHERE queue = %(queue)s::text
  AND (visible_at <= pg_catalog.now() OR visible_at = 'infinity'::timestamptz)
  AND (expires_at IS NULL OR expires_at > pg_catalog.now())

-- name: purge
-- Delete a queue's waiting messages (ready or delayed, not in flight); return how many.
-- Waiting: visible now, never delivered (delayed), or parked by a claim's gate (due_at
-- set), until an earlier message of its key leaves ('infinity') or until a time (a
-- follower's wait, a key's lease in flight): a parked message delivered before and
-- handed back has read_ct > 0 and a visible_at to come, and is waiting all the same.
-- A row locked right now is skipped, never waited for: an atomic task's transaction is
-- completing it (its lease lapsed, its fence holds the row until the commit; its end is
-- that commit's), or a claim is taking it (docs/design/exactly-once.md, "Locks").
WITH purged AS (
    DELETE FROM {schema}.message AS m
    WHERE m.id IN (SELECT x.id FROM {schema}.message AS x
                   WHERE x.queue = %(queue)s
                     AND (x.visible_at <= pg_catalog.now() OR x.read_ct = 0
                          OR x.due_at IS NOT NULL OR x.visible_at = 'infinity'::timestamptz)
                   FOR UPDATE SKIP LOCKED)
    RETURNING 1
)
SELECT pg_catalog.count(*) FROM purged

-- name: declare_queue
-- Record a declared queue; declaring again updates its expiry and TTL and counts as use.
-- Its ordering failure mode is set only by a declarer configured with one (NULL: keep).
-- Fair mode likewise (NULL: keep).
INSERT INTO {schema}.queue AS q (name, expires_ms, message_ttl_ms, ordering, fair)
VALUES (%(queue)s, %(expires_ms)s, %(message_ttl_ms)s, %(ordering)s,
        COALESCE(%(fair)s::boolean, false))
ON CONFLICT (name) DO UPDATE
SET expires_ms = EXCLUDED.expires_ms, message_ttl_ms = EXCLUDED.message_ttl_ms,
    ordering = COALESCE(EXCLUDED.ordering, q.ordering),
    fair = COALESCE(%(fair)s::boolean, q.fair),
    last_used = pg_catalog.now()

-- name: fair_adopt
-- A queue declared fair: its messages published before (no fair key) take the key '',
-- so the fair pick, which walks keys only, reaches them.
UPDATE {schema}.message AS m SET fkey = ''
WHERE m.queue = %(queue)s::text AND m.fkey IS NULL
  AND (SELECT q.fair FROM {schema}.queue AS q WHERE q.name = %(queue)s::text)

-- name: queue_limit
-- The name of a queue's own flow limit (queue:<name>), or no row: a consumer without
-- acks may not consume a queue that has one (see pop).
SELECT l.name FROM {schema}.flow_limit AS l WHERE l.name = 'queue:' || %(queue)s::text

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
-- Bind a queue to a declared exchange; true when the exchange exists. Binding again
-- rewrites the pattern (one an older pgq stored may not have been a valid regex).
WITH found AS (
    SELECT name FROM {schema}.exchange WHERE name = %(exchange)s
), inserted AS (
    INSERT INTO {schema}.binding (exchange, queue, routing_key, pattern)
    SELECT found.name, %(queue)s, %(routing_key)s, %(pattern)s FROM found
    ON CONFLICT (exchange, routing_key, queue) DO UPDATE SET pattern = EXCLUDED.pattern
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
-- the exchange's type (NULL: never declared) and how many queues matched. Every matched
-- queue's listeners are woken (for a delayed message too: they ask when it falls due),
-- whether its copy was inserted now or found there: a publish sent again after its
-- session was lost finds its copies committed, and their wake-up may have been lost with
-- that session. At worst a wake-up too many.
-- A message with a unique key (ukey) is inserted only when exactly one queue matched (one
-- copy per queue would conflict with itself), waits for a holder's open transaction at
-- most unique_wait, and, when nothing was inserted, names the holder as publish_unique does.
WITH ex AS (
    SELECT type FROM {schema}.exchange WHERE name = %(exchange)s::text
), waits AS MATERIALIZED (
    SELECT pg_catalog.current_setting('lock_timeout') AS before,
           CASE WHEN %(ukey)s::text IS NOT NULL
                THEN pg_catalog.set_config('lock_timeout', %(unique_wait)s::text, true) END
               AS set
), targets AS (
    SELECT DISTINCT b.queue
    FROM {schema}.binding AS b CROSS JOIN ex
    WHERE b.exchange = %(exchange)s::text
      AND CASE ex.type
              WHEN 'fanout' THEN true
              WHEN 'topic' THEN %(routing_key)s::text OPERATOR(pg_catalog.~) b.pattern
              ELSE b.routing_key = %(routing_key)s::text
          END
), inserted AS (
    INSERT INTO {schema}.message (queue, priority, visible_at, publish_key, payload, expires_at,
                                  okey, task_id, follows, follow_until, followable, ukey, urun,
                                  fkey)
    SELECT t.queue, %(priority)s,
           pg_catalog.now() + pg_catalog.make_interval(secs => %(delay)s::float8),
           pg_catalog.md5(%(publish_tag)s::text || t.queue), %(payload)s,
           pg_catalog.now() + pg_catalog.make_interval(
               secs => LEAST(q.message_ttl_ms::float8 / 1000.0::float8, %(ttl)s::float8)),
           %(okey)s::text, %(task_id)s::text, %(follows)s::text,
           pg_catalog.now() + pg_catalog.make_interval(
               secs => %(delay)s::float8 + %(follow_wait)s::float8),
           %(followable)s::boolean, %(ukey)s::text, %(urun)s::boolean,
           CASE WHEN q.fair THEN COALESCE(%(fkey)s::text, '') END
    FROM targets AS t
    CROSS JOIN waits
    LEFT JOIN {schema}.queue AS q ON q.name = t.queue
    WHERE %(ukey)s::text IS NULL OR (SELECT pg_catalog.count(*) FROM targets) = 1
    ON CONFLICT DO NOTHING
    RETURNING 1
), woken AS (
    SELECT pg_catalog.pg_notify(
               %(channel_prefix)s::text
               || pg_catalog.md5(pg_catalog.convert_to(t.queue, 'UTF8')), '')
    FROM targets AS t
    WHERE %(wake)s::boolean
)
SELECT (SELECT type FROM ex), (SELECT pg_catalog.count(*) FROM targets),
       (SELECT pg_catalog.count(*) FROM woken),
       CASE WHEN %(ukey)s::text IS NOT NULL AND NOT EXISTS (SELECT FROM inserted)
                 AND (SELECT pg_catalog.count(*) FROM targets) = 1
            THEN {schema}.unique_holder(
                %(ukey)s::text,
                (SELECT pg_catalog.md5(%(publish_tag)s::text || t.queue) FROM targets AS t))
       END AS holder,
       (SELECT w.before FROM waits AS w) AS lock_timeout,
       (SELECT pg_catalog.count(*) FROM inserted) AS inserted

-- name: wake_routed
-- Wake the queues an exchange routes a routing key to, as publish_routed does, after a
-- publish_routed sent with wake false committed (a transaction of its own, sent with
-- it: see wake). The route is looked up again; a binding changed in between makes a
-- wake-up too many or one missing, which the poll makes good.
SELECT pg_catalog.count(pg_catalog.pg_notify(
           %(channel_prefix)s::text || pg_catalog.md5(pg_catalog.convert_to(t.queue, 'UTF8')),
           ''))
FROM (
    SELECT DISTINCT b.queue
    FROM {schema}.binding AS b
    JOIN {schema}.exchange AS e ON e.name = b.exchange
    WHERE b.exchange = %(exchange)s::text
      AND CASE e.type
              WHEN 'fanout' THEN true
              WHEN 'topic' THEN %(routing_key)s::text OPERATOR(pg_catalog.~) b.pattern
              ELSE b.routing_key = %(routing_key)s::text
          END
) AS t

-- name: dead_letter_unroutable
-- Keep a message no queue was bound to receive, under its routing key as queue name.
INSERT INTO {schema}.dead_letter
    (message_id, queue, priority, read_ct, enqueued_at, reason, payload)
VALUES (0, %(queue)s, %(priority)s, 0, pg_catalog.now(), %(reason)s, %(payload)s)
RETURNING id

-- name: maintain
-- Mark the queues this consumer uses as in use; delete queues unused past their
-- expiry (with their bindings), queued messages past their TTL (a parked or deferred
-- one, due_at set, is queued even if delivered before) and the recorded ends of
-- followed tasks past follows_retention. Returns the names
-- of the deleted queues (drop_messages then deletes their messages) and how many
-- messages expired. Safe to run from every consumer at once.
WITH touched AS (
    UPDATE {schema}.queue SET last_used = pg_catalog.now()
    WHERE name = ANY(%(queues)s::text[])
    RETURNING name
), gone AS (
    DELETE FROM {schema}.queue AS q
    WHERE q.expires_ms IS NOT NULL
      AND q.last_used + pg_catalog.make_interval(secs => q.expires_ms::float8 / 1000.0::float8)
          < pg_catalog.now()
      AND q.name <> ALL(%(queues)s::text[])
    RETURNING q.name
), unbound AS (
    DELETE FROM {schema}.binding AS b WHERE b.queue = ANY(ARRAY(SELECT name FROM gone))
), expired AS (
    -- Waiting messages only (as purge): visible, never delivered, or parked by a claim
    -- (due_at set, delivered before or not); one in flight is its holder's to end. A
    -- row locked right now (an atomic task's fence holding a lapsed delivery until its
    -- commit, a claim taking it) is skipped, never waited for: the next run reaps it.
    DELETE FROM {schema}.message AS m
    WHERE m.id IN (SELECT x.id FROM {schema}.message AS x
                   WHERE x.expires_at < pg_catalog.now()
                     AND (x.read_ct = 0 OR x.visible_at <= pg_catalog.now()
                          OR x.due_at IS NOT NULL)
                   FOR UPDATE SKIP LOCKED)
    RETURNING 1
), forgotten AS (
    -- Ends of followed tasks past follows_retention (0011_ordering.sql).
    DELETE FROM {schema}.follow_done AS d
    WHERE d.finished_at
          < pg_catalog.now() - pg_catalog.make_interval(secs => %(follows_retention)s::float8)
), idle_buckets AS (
    -- Flow state of keys unused for a day (0016_flow_limits.sql): a bucket idle that
    -- long is full again anyway, and a slot's row only serialises its claims.
    DELETE FROM {schema}.flow_state AS s
    WHERE s.used_at < pg_catalog.now() - interval '1 day'
)
SELECT ARRAY(SELECT name FROM gone), (SELECT pg_catalog.count(*) FROM expired)

-- name: define_limits
-- The flow limits configuration defines (task attributes, transport options), written
-- at worker start with origin config: one a command set (origin command) is kept until
-- `pgq limit reset`. One array a column, one element a limit.
INSERT INTO {schema}.flow_limit AS l (name, rate_count, rate_period, burst, concurrency, origin)
SELECT g.name, g.rate_count, g.rate_period, g.burst, g.concurrency, 'config'
FROM ROWS FROM (pg_catalog.unnest(%(names)s::text[]),
                pg_catalog.unnest(%(rate_counts)s::integer[]),
                pg_catalog.unnest(%(rate_periods)s::float8[]),
                pg_catalog.unnest(%(bursts)s::integer[]),
                pg_catalog.unnest(%(concurrencies)s::integer[]))
    AS g(name, rate_count, rate_period, burst, concurrency)
ON CONFLICT (name) DO UPDATE
SET rate_count = EXCLUDED.rate_count, rate_period = EXCLUDED.rate_period,
    burst = EXCLUDED.burst, concurrency = EXCLUDED.concurrency,
    updated_at = pg_catalog.now()
WHERE l.origin = 'config'
  AND (l.rate_count, l.rate_period, l.burst, l.concurrency)
      IS DISTINCT FROM (EXCLUDED.rate_count, EXCLUDED.rate_period, EXCLUDED.burst,
                        EXCLUDED.concurrency)

-- name: drop_messages
-- Delete every message of the given queues (queues that expired). A statement of its
-- own, planned for the names it gets: a join on queue names the planner cannot see
-- could become a scan of every message.
DELETE FROM {schema}.message WHERE queue = ANY(%(queues)s::text[])

-- name: dead_rows
-- Dead row versions in the message table (cumulative statistics, a second or so behind)
-- and whether this role may vacuum it (its owner or a member of the owner).
SELECT s.relname, s.n_dead_tup, pg_catalog.pg_has_role(current_user, c.relowner, 'USAGE')
FROM pg_catalog.pg_stat_user_tables AS s
JOIN pg_catalog.pg_class AS c ON c.oid = s.relid
WHERE s.schemaname = %(schema)s::name AND s.relname = 'message'

-- name: vacuum
-- Remove the message table's dead rows; skipped when another VACUUM holds the table.
VACUUM (SKIP_LOCKED) {schema}.message

-- name: has_version_table
-- Whether the schema has been created (its version table exists). A plain query
-- of pg_class, not to_regclass(): after waiting on the migration lock the catalog
-- cache may predate the winner's commit, a fresh statement snapshot does not.
SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_class AS c
    JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = %(schema)s::name AND c.relname = 'schema_version'
)

-- name: applied_version
-- The highest migration applied (the table is known to exist).
SELECT COALESCE(pg_catalog.max(version), 0) FROM {schema}.schema_version

-- name: record_version
-- Record an applied migration.
INSERT INTO {schema}.schema_version (version) VALUES (%(version)s)

-- name: create_schema
-- Create the schema itself (migrations create what is in it).
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: migrate_lock
-- Serialise upgrades of one schema until the transaction ends. A lock on a table of the
-- schema, in a mode only a role that may write that table can take (and that conflicts
-- with itself): a role that can merely connect cannot hold it, as it could any advisory
-- key. (A schema not created yet has no table to lock: its creators race on the
-- catalog's unique names instead, and the losers try again.)
LOCK TABLE {schema}.schema_version IN SHARE ROW EXCLUSIVE MODE

-- name: listen
-- Subscribe this session to a queue's wake-up channel ({channel}: queue_channel).
LISTEN {channel}

-- name: ping
-- A round trip: notifications of transactions that finished committing before it
-- arrive first. The tests read sessions with it.
SELECT 1

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

-- name: relax_commit_unless_synchronous
-- relax_commit, unless the server has synchronous standbys (durable_acks=auto): then an
-- ack returns once a standby has it, and a failover to that standby does not run the
-- acked task again. Read when the session opens.
SELECT pg_catalog.set_config('synchronous_commit', 'off', false)
WHERE pg_catalog.current_setting('synchronous_standby_names') = ''

-- name: schema_owner
-- The role owning the schema, or no row when the schema does not exist.
SELECT nspowner::regrole::text FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s::name

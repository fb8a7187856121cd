-- Named queries of the result backend. Each block starts with "-- name: <name>" and a
-- one-line description; {schema} is composed as an identifier, values are bound.
-- Loaded with loader.load_named("results.sql", schema, "pg_transport.results").

-- name: result_store
-- Store a task's state. A SUCCESS already stored is never replaced (a lost worker's late
-- update, or a redelivery's STARTED, must not hide a finished result); no row returned then.
INSERT INTO {schema}.result AS r
    (task_id, status, content_type, content_encoding, meta, date_done, expires_at, updated_at)
VALUES (%(task_id)s, %(status)s, %(content_type)s, %(content_encoding)s, %(meta)s,
        %(date_done)s,
        pg_catalog.now() + pg_catalog.make_interval(secs => %(expires)s::float8),
        pg_catalog.now())
ON CONFLICT (task_id) DO UPDATE
SET status = excluded.status,
    content_type = excluded.content_type,
    content_encoding = excluded.content_encoding,
    meta = excluded.meta,
    date_done = excluded.date_done,
    expires_at = excluded.expires_at,
    updated_at = excluded.updated_at
WHERE r.status <> 'SUCCESS'
RETURNING r.status

-- name: result_notify
-- Wake the waiters of one task: the channel names it, the payload is empty.
SELECT pg_catalog.pg_notify(%(channel)s::text, '')

-- name: result_get
-- One task's stored state. Reads go through result_read, which takes ids (schema.sql).
SELECT status, content_type, content_encoding, meta
FROM {schema}.result_read(ARRAY[%(task_id)s::text])

-- name: result_get_many
-- The stored states of many tasks (every waiter of a process in one statement).
SELECT task_id, status, content_type, content_encoding, meta, updated_at
FROM {schema}.result_read(%(ids)s::text[])

-- name: result_forget
-- Delete one task's state.
SELECT {schema}.result_forget(%(task_id)s::text)

-- name: group_save
-- Save a GroupResult (its member ids, encoded); saving again replaces it.
SELECT {schema}.result_group_save(
    %(group_id)s::text, %(content_type)s::text, %(content_encoding)s::text, %(meta)s::bytea,
    %(expires)s::float8
)

-- name: group_get
-- One saved GroupResult.
SELECT content_type, content_encoding, meta FROM {schema}.result_group_read(%(group_id)s::text)

-- name: group_delete
-- Delete a saved GroupResult.
SELECT {schema}.result_group_delete(%(group_id)s::text)

-- name: result_reap
-- Delete up to limit results and groups past their expiry. Rows another reaper (or a
-- store) holds are skipped, not waited for: every worker may reap at once.
WITH due AS (
    SELECT task_id FROM {schema}.result
    WHERE expires_at <= pg_catalog.now()
    ORDER BY expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {schema}.result AS r USING due WHERE r.task_id = due.task_id
    RETURNING 1
), due_groups AS (
    SELECT group_id FROM {schema}.result_group
    WHERE expires_at <= pg_catalog.now()
    ORDER BY expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone_groups AS (
    DELETE FROM {schema}.result_group AS g USING due_groups
    WHERE g.group_id = due_groups.group_id
    RETURNING 1
)
SELECT (SELECT pg_catalog.count(*) FROM gone), (SELECT pg_catalog.count(*) FROM gone_groups)

-- name: result_reset
-- Forget the states of tasks whose messages go back to their queues (PENDING again).
DELETE FROM {schema}.result WHERE task_id = ANY(%(ids)s::text[])

-- name: chord_arm
-- Arm a chord's fan-in for one run. A chord applied again (a frozen chord keeps its group
-- id) starts a new run: total, remaining, status and callback are reset and the run number
-- (in the metadata; it names the run's messages' publish keys) is bumped. The caller
-- deletes the previous run's parts after this, in the same transaction.
INSERT INTO {schema}.barrier AS b
    (id, total, remaining, callback, errback, metadata, expires_at, stuck_timeout)
VALUES (%(id)s, %(total)s, %(total)s, %(callback)s::json, NULL,
        %(metadata)s || pg_catalog.jsonb_build_object('run', 1),
        pg_catalog.now() + pg_catalog.make_interval(secs => %(ttl)s),
        pg_catalog.make_interval(secs => %(stuck_timeout)s))
ON CONFLICT (id) DO UPDATE
SET total = excluded.total,
    remaining = excluded.remaining,
    status = 'armed',
    callback = excluded.callback,
    errback = NULL,
    metadata = %(metadata)s || pg_catalog.jsonb_build_object(
        'run', COALESCE((b.metadata ->> 'run')::integer, 1) + 1),
    reason = NULL,
    created_at = pg_catalog.now(),
    progressed_at = pg_catalog.now(),
    expires_at = excluded.expires_at,
    stuck_timeout = excluded.stuck_timeout,
    fired_at = NULL,
    finished_at = NULL
RETURNING (b.metadata ->> 'run')::integer

-- name: chord_forget_parts
-- The parts of a chord's previous run (a new run was just armed).
DELETE FROM {schema}.barrier_part WHERE barrier_id = %(id)s

-- name: chord_set_size
-- A streamed chord's size, known once its generator header is read (set before its last
-- part is sent). Parts may have counted already, each against the unsized total: remaining
-- becomes size - counted. Only once, only while armed; a size below the parts counted
-- updates nothing.
UPDATE {schema}.barrier
SET total = %(size)s,
    remaining = remaining - (total - %(size)s),
    progressed_at = pg_catalog.now(),
    metadata = metadata || '{{"sized": true}}'::jsonb
WHERE id = %(id)s AND status = 'armed' AND total = %(unsized)s
  AND COALESCE((metadata ->> 'streamed')::boolean, false)
  AND remaining - (total - %(size)s) >= 0
RETURNING remaining

-- name: chord_add
-- add_to_chord: one more part, after the header's (and earlier additions'), counted like
-- them. Only while the chord is armed and its size is known.
UPDATE {schema}.barrier
SET total = total + 1,
    remaining = remaining + 1,
    metadata = pg_catalog.jsonb_set(
        metadata, '{{added}}',
        COALESCE(metadata -> 'added', '{{}}'::jsonb)
            || pg_catalog.jsonb_build_object(%(task_id)s::text, total))
WHERE id = %(id)s AND status = 'armed' AND total < %(unsized)s
  AND NOT (COALESCE(metadata -> 'added', '{{}}'::jsonb) ? %(task_id)s::text)
RETURNING total

-- name: chord_status
-- A chord's status and whether its size is known.
SELECT status, total < %(unsized)s FROM {schema}.barrier WHERE id = %(id)s

-- name: chord_part_record
-- Record a chord part once, at its place: a task added with add_to_chord at the place it
-- was given; a part of a listed header at its task id's place in the header (the metadata
-- lists the header's ids). A redelivered part, an unknown chord, a part of a streamed
-- header (chord_part_record_streamed) or a task that is not a part inserts nothing.
INSERT INTO {schema}.barrier_part (barrier_id, idx, task_id, outcome, result)
SELECT b.id, p.idx, %(task_id)s, %(outcome)s, %(result)s::json
FROM {schema}.barrier AS b
CROSS JOIN LATERAL (
    SELECT (b.metadata -> 'added' ->> %(task_id)s::text)::integer
    WHERE b.metadata -> 'added' ? %(task_id)s::text
    UNION ALL
    SELECT (e.ord - 1)::integer
    FROM pg_catalog.jsonb_array_elements_text(b.metadata -> 'ids')
        WITH ORDINALITY AS e(task_id, ord)
    WHERE e.task_id = %(task_id)s
      AND NOT COALESCE((b.metadata ->> 'streamed')::boolean, false)
) AS p(idx)
WHERE b.id = %(id)s AND p.idx IS NOT NULL
ON CONFLICT (barrier_id, idx) DO NOTHING
RETURNING idx

-- name: chord_lock_streamed
-- Lock a streamed chord's row (to commit) before placing a part of its header.
SELECT 1 FROM {schema}.barrier
WHERE id = %(id)s AND COALESCE((metadata ->> 'streamed')::boolean, false)
FOR UPDATE

-- name: chord_part_record_streamed
-- Record a part of a streamed (generator) header once: its task id not recorded yet. Its
-- header place is its group index, kept with it (a group nested in the header numbers
-- its tasks from 0 again, so two parts may share one); its row takes the next negative
-- idx, in arrival order, apart from the non-negative ones of tasks added with
-- add_to_chord. Run under chord_lock_streamed's lock, in a statement of its own: it sees
-- every part recorded before.
INSERT INTO {schema}.barrier_part (barrier_id, idx, task_id, outcome, result)
SELECT b.id,
       -1 - (SELECT pg_catalog.count(*) FROM {schema}.barrier_part AS p
             WHERE p.barrier_id = b.id AND p.idx < 0)::integer,
       %(task_id)s, %(outcome)s,
       pg_catalog.json_build_object('index', %(index)s::integer, 'note', %(result)s::json)
FROM {schema}.barrier AS b
WHERE b.id = %(id)s
  AND NOT COALESCE(b.metadata -> 'added' ? %(task_id)s::text, false)
  AND NOT EXISTS (SELECT 1 FROM {schema}.barrier_part AS p
                  WHERE p.barrier_id = b.id AND p.task_id = %(task_id)s)
ON CONFLICT (barrier_id, idx) DO NOTHING
RETURNING idx

-- name: chord_results
-- The header's stored results in header order: a streamed header's parts (negative idx) by
-- group index, then arrival; a listed header's and added tasks' by idx.
SELECT p.task_id, r.status, r.content_type, r.content_encoding, r.meta
FROM {schema}.barrier_part AS p
LEFT JOIN {schema}.result AS r ON r.task_id = p.task_id
WHERE p.barrier_id = %(id)s AND p.outcome = 'succeeded'
ORDER BY p.idx >= 0, (p.result ->> 'index')::integer, pg_catalog.abs(p.idx)

-- name: chord_fire
-- The armed -> fired flip, only for a chord with nothing remaining; the loser gets no row.
UPDATE {schema}.barrier
SET status = 'fired', fired_at = pg_catalog.now()
WHERE id = %(id)s AND status = 'armed' AND remaining = 0
RETURNING callback::text, total, COALESCE(metadata ->> 'run', '1')

-- name: chord_callback
-- A chord's body (a Celery signature as JSON text), its run and its status (read before
-- its failure's flip, to make that failure ready without holding the row).
SELECT callback::text, COALESCE(metadata ->> 'run', '1'), status
FROM {schema}.barrier WHERE id = %(id)s

-- 0018: a queue's own concurrency limit, what the monitor may read of unique tasks and
-- flow limits, and one function for a flow bucket's first use
-- (docs/design/flow-control.md, "Migration 0018").

-- Whole-queue concurrency (docs/flow-control.md): the limit queue:<name> with a
-- concurrency holds at most that many of the queue's messages leased at once. A message
-- holds (or waits for) its queue's slot when qslot is true, written by the claim only,
-- and only in a queue with such a limit: every other message adds no index entry.
ALTER TABLE {schema}.message ADD COLUMN qslot boolean NOT NULL DEFAULT false;

-- The messages of a queue that hold its slot or may (not parked): counted by
-- flow_queue_slots().
CREATE INDEX message_queue_slot_live_idx ON {schema}.message (queue)
    WHERE qslot AND visible_at < 'infinity'::timestamptz;
-- The messages of a queue waiting for its slot, earliest first: promoted by
-- flow_queue_leave().
CREATE INDEX message_queue_slot_wait_idx ON {schema}.message (queue, due_at)
    WHERE qslot AND due_at IS NOT NULL;

-- A queue's slots: flow_slots' shape over the queue's holders (its bucket is
-- ('queue:<name>', '')): how many of want messages may start now, and the earliest lease
-- end of those in flight; -1 busy. Locks the queue's row, then counts in a fresh
-- snapshot, holders counted twice (all and those it can share-lock), as flow_slots.
CREATE FUNCTION {schema}.flow_queue_slots(queue text, want integer)
RETURNS TABLE (granted integer, next_at timestamptz)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    own text := 'queue:' || queue;
    cap integer;
    live integer;
    locked integer;
    ends timestamptz;
BEGIN
    SELECT l.concurrency INTO cap FROM {schema}.flow_limit AS l WHERE l.name = own;
    IF cap IS NULL THEN
        RETURN QUERY SELECT want, NULL::timestamptz;
        RETURN;
    END IF;
    PERFORM FROM {schema}.flow_state AS s
    WHERE s.limiter = own AND s.key = ''
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND AND NOT EXISTS (SELECT FROM {schema}.flow_state AS s
                                 WHERE s.limiter = own AND s.key = '') THEN
        -- The queue's first use: its row (flow_bucket), then its lock.
        PERFORM {schema}.flow_bucket(own, '');
        PERFORM FROM {schema}.flow_state AS s
        WHERE s.limiter = own AND s.key = ''
        FOR UPDATE SKIP LOCKED;
    END IF;
    IF NOT FOUND THEN
        RETURN QUERY SELECT -1, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT pg_catalog.count(*)::integer, pg_catalog.min(m.visible_at) INTO live, ends
    FROM {schema}.message AS m
    WHERE m.queue = flow_queue_slots.queue AND m.qslot
      AND m.visible_at < 'infinity'::timestamptz
      AND m.read_ct > 0 AND m.visible_at > pg_catalog.now() AND m.due_at IS NULL;
    SELECT pg_catalog.count(*)::integer INTO locked FROM (
        SELECT FROM {schema}.message AS m
        WHERE m.queue = flow_queue_slots.queue AND m.qslot
          AND m.visible_at < 'infinity'::timestamptz
          AND m.read_ct > 0 AND m.visible_at > pg_catalog.now() AND m.due_at IS NULL
        FOR SHARE OF m SKIP LOCKED) AS h;
    IF locked <> live THEN
        RETURN QUERY SELECT -1, NULL::timestamptz;
        RETURN;
    END IF;
    RETURN QUERY SELECT LEAST(want, GREATEST(cap - live, 0)), ends;
END
$$;

-- After a message that held or waited for its queue's slot left the table: the queue's
-- earliest waiting message is made visible now (its place kept) and the queue woken, as
-- flow_leave does for a key.
CREATE FUNCTION {schema}.flow_queue_leave() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    woken text;
BEGIN
    UPDATE {schema}.message AS m
    SET visible_at = LEAST(m.due_at, pg_catalog.now()), due_at = NULL
    WHERE m.id = (SELECT w.id FROM {schema}.message AS w
                  WHERE w.queue = OLD.queue AND w.qslot AND w.due_at IS NOT NULL
                    AND w.visible_at > pg_catalog.now()
                    AND w.visible_at < 'infinity'::timestamptz
                  ORDER BY w.due_at, w.id
                  LIMIT 1
                  FOR NO KEY UPDATE SKIP LOCKED)
    RETURNING m.queue INTO woken;
    IF woken IS NOT NULL THEN
        PERFORM pg_catalog.pg_notify(
            {channel_prefix}::text || pg_catalog.md5(pg_catalog.convert_to(woken, 'UTF8')), '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER message_leave_queue_slot AFTER DELETE ON {schema}.message
FOR EACH ROW WHEN (OLD.qslot) EXECUTE FUNCTION {schema}.flow_queue_leave();

REVOKE ALL ON FUNCTION {schema}.flow_queue_leave() FROM PUBLIC;

-- A bucket's first use (flow_tokens, flow_slots): its row, without waiting for another
-- claim that is inserting it too: with lock_timeout 1 ms, in a subtransaction, so that
-- a claim that has the bucket makes this one give up at once (the caller finds the row
-- locked and the bucket busy). The caller's lock_timeout is put back. SECURITY INVOKER,
-- as its callers, with EXECUTE for PUBLIC as theirs: it writes nothing the caller may not.
CREATE FUNCTION {schema}.flow_bucket(limiter text, bucket text) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    wait text;
BEGIN
    wait := pg_catalog.current_setting('lock_timeout');
    PERFORM pg_catalog.set_config('lock_timeout', '1ms', true);
    BEGIN
        INSERT INTO {schema}.flow_state (limiter, key) VALUES (limiter, bucket)
        ON CONFLICT DO NOTHING;
    EXCEPTION WHEN lock_not_available THEN
        NULL;
    END;
    PERFORM pg_catalog.set_config('lock_timeout', wait, true);
END
$$;

-- flow_tokens and flow_slots call flow_bucket for a bucket's first use (the same block
-- each carried before; no change of behaviour).
CREATE OR REPLACE FUNCTION {schema}.flow_tokens(limiter text, bucket text, want integer)
RETURNS TABLE (granted integer, next_at timestamptz, step float8)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    lim record;
    arrival timestamptz;
    t timestamptz;
    base timestamptz;
    emission float8;
    tau float8;
    late float8;
    g integer;
BEGIN
    SELECT l.rate_count, l.rate_period, l.burst INTO lim
    FROM {schema}.flow_limit AS l WHERE l.name = limiter;
    IF lim.rate_count IS NULL THEN
        RETURN QUERY SELECT want, NULL::timestamptz, NULL::float8;
        RETURN;
    END IF;
    SELECT s.tat INTO arrival FROM {schema}.flow_state AS s
    WHERE s.limiter = flow_tokens.limiter AND s.key = bucket
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND AND NOT EXISTS (SELECT FROM {schema}.flow_state AS s
                                 WHERE s.limiter = flow_tokens.limiter AND s.key = bucket) THEN
        -- The bucket's first use: its row (flow_bucket), then its lock.
        PERFORM {schema}.flow_bucket(limiter, bucket);
        SELECT s.tat INTO arrival FROM {schema}.flow_state AS s
        WHERE s.limiter = flow_tokens.limiter AND s.key = bucket
        FOR UPDATE SKIP LOCKED;
    END IF;
    IF NOT FOUND THEN
        RETURN QUERY SELECT -1, NULL::timestamptz, NULL::float8;
        RETURN;
    END IF;
    t := pg_catalog.clock_timestamp();
    emission := lim.rate_period / lim.rate_count;
    tau := (lim.burst - 1) * emission;
    base := GREATEST(arrival, t);
    late := EXTRACT(EPOCH FROM base - t)::float8;
    IF late > tau + 1e-6 THEN
        g := 0;
    ELSE
        g := LEAST(want, pg_catalog.floor((tau - late) / emission + 1e-9)::integer + 1);
    END IF;
    arrival := base + pg_catalog.make_interval(secs => g * emission);
    UPDATE {schema}.flow_state AS s SET tat = arrival, used_at = t
    WHERE s.limiter = flow_tokens.limiter AND s.key = bucket;
    RETURN QUERY SELECT g, arrival - pg_catalog.make_interval(secs => tau), emission;
END
$$;

CREATE OR REPLACE FUNCTION {schema}.flow_slots(limiter text, bucket text, want integer)
RETURNS TABLE (granted integer, next_at timestamptz)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cap integer;
    live integer;
    locked integer;
    ends timestamptz;
BEGIN
    SELECT l.concurrency INTO cap FROM {schema}.flow_limit AS l WHERE l.name = limiter;
    IF cap IS NULL THEN
        RETURN QUERY SELECT want, NULL::timestamptz;
        RETURN;
    END IF;
    PERFORM FROM {schema}.flow_state AS s
    WHERE s.limiter = flow_slots.limiter AND s.key = bucket
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND AND NOT EXISTS (SELECT FROM {schema}.flow_state AS s
                                 WHERE s.limiter = flow_slots.limiter AND s.key = bucket) THEN
        -- The key's first use: its row (flow_bucket), then its lock.
        PERFORM {schema}.flow_bucket(limiter, bucket);
        PERFORM FROM {schema}.flow_state AS s
        WHERE s.limiter = flow_slots.limiter AND s.key = bucket
        FOR UPDATE SKIP LOCKED;
    END IF;
    IF NOT FOUND THEN
        RETURN QUERY SELECT -1, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT pg_catalog.count(*)::integer, pg_catalog.min(m.visible_at) INTO live, ends
    FROM {schema}.message AS m
    WHERE m.climit = flow_slots.limiter AND m.ckey = bucket
      AND m.visible_at < 'infinity'::timestamptz
      AND m.read_ct > 0 AND m.visible_at > pg_catalog.now() AND m.due_at IS NULL;
    SELECT pg_catalog.count(*)::integer INTO locked FROM (
        SELECT FROM {schema}.message AS m
        WHERE m.climit = flow_slots.limiter AND m.ckey = bucket
          AND m.visible_at < 'infinity'::timestamptz
          AND m.read_ct > 0 AND m.visible_at > pg_catalog.now() AND m.due_at IS NULL
        FOR SHARE OF m SKIP LOCKED) AS h;
    IF locked <> live THEN
        RETURN QUERY SELECT -1, NULL::timestamptz;
        RETURN;
    END IF;
    RETURN QUERY SELECT LEAST(want, GREATEST(cap - live, 0)), ends;
END
$$;

-- Unique keys held, per queue: how many messages hold one while queued (not leased)
-- and while running (leased, held with unique_while="queued_or_running"). Counts only:
-- the monitor may not read message.ukey, and through this learns no key. Runs as the
-- owner, names resolved in pg_catalog only; EXECUTE is granted by least-privilege.md's
-- blocks (the worker's and the monitor's), to no one by default.
CREATE FUNCTION {schema}.unique_counts()
RETURNS TABLE (queue text, queued bigint, running bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT m.queue,
           pg_catalog.count(*) FILTER (WHERE NOT h.leased),
           pg_catalog.count(*) FILTER (WHERE h.leased)
    FROM {schema}.message AS m
    CROSS JOIN LATERAL (
        SELECT m.read_ct > 0 AND m.visible_at > pg_catalog.now()
               AND m.visible_at < 'infinity'::timestamptz AND m.due_at IS NULL AS leased
    ) AS h
    WHERE m.ukey IS NOT NULL
    GROUP BY m.queue
    ORDER BY m.queue
$$;

REVOKE ALL ON FUNCTION {schema}.unique_counts() FROM PUBLIC;

-- The flow limits as `pgq limit list` and `pgq limit show` print them: each limit (or
-- the one named) with its definition; the tokens its keyless bucket has now (GCRA:
-- floor((tau - max(tat - now, 0)) / T) + 1, at most burst; NULL without a rate); the
-- messages holding one of its slots and those parked for one (a key's, or, for a limit
-- queue:<name>, the queue's: qslot); how many keys it has
-- state for. Counts, definitions and tokens only, never a key: the monitor may not read
-- flow_state, whose keys are the application's values. Runs as the owner, names
-- resolved in pg_catalog only; EXECUTE as for unique_counts.
CREATE FUNCTION {schema}.flow_limit_states(wanted text)
RETURNS TABLE (name text, rate_count integer, rate_period float8, burst integer,
               concurrency integer, origin text, updated_at timestamptz, tokens integer,
               in_flight bigint, waiting bigint, keys bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT l.name, l.rate_count, l.rate_period, l.burst, l.concurrency, l.origin,
           l.updated_at,
           CASE WHEN l.rate_count IS NOT NULL THEN GREATEST(0, LEAST(l.burst,
               pg_catalog.floor(((l.burst - 1) * l.rate_period / l.rate_count
                   - GREATEST(0::float8, COALESCE(EXTRACT(EPOCH FROM
                         GREATEST((SELECT s.tat FROM {schema}.flow_state AS s
                                   WHERE s.limiter = l.name AND s.key = ''),
                                  pg_catalog.statement_timestamp())
                         - pg_catalog.statement_timestamp())::float8, 0::float8)))
                   / (l.rate_period / l.rate_count) + 1e-9)::integer + 1))::integer END,
           (SELECT pg_catalog.count(*) FROM {schema}.message AS m
            WHERE m.climit = l.name AND m.visible_at < 'infinity'::timestamptz
              AND m.read_ct > 0 AND m.visible_at > pg_catalog.now() AND m.due_at IS NULL)
           + CASE WHEN pg_catalog.left(l.name, 6) = 'queue:' THEN
                 (SELECT pg_catalog.count(*) FROM {schema}.message AS m
                  WHERE m.queue = pg_catalog.substr(l.name, 7) AND m.qslot
                    AND m.visible_at < 'infinity'::timestamptz AND m.read_ct > 0
                    AND m.visible_at > pg_catalog.now() AND m.due_at IS NULL)
             ELSE 0 END,
           (SELECT pg_catalog.count(*) FROM {schema}.message AS m
            WHERE m.climit = l.name AND m.due_at IS NOT NULL)
           + CASE WHEN pg_catalog.left(l.name, 6) = 'queue:' THEN
                 (SELECT pg_catalog.count(*) FROM {schema}.message AS m
                  WHERE m.queue = pg_catalog.substr(l.name, 7) AND m.qslot
                    AND m.due_at IS NOT NULL)
             ELSE 0 END,
           (SELECT pg_catalog.count(*) FROM {schema}.flow_state AS s WHERE s.limiter = l.name)
    FROM {schema}.flow_limit AS l
    WHERE wanted IS NULL OR l.name = wanted
    ORDER BY l.name
$$;

REVOKE ALL ON FUNCTION {schema}.flow_limit_states(text) FROM PUBLIC;

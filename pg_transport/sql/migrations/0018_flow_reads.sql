-- 0018: what the monitor may read of unique tasks and flow limits, and one function for
-- a flow bucket's first use (docs/design/flow-control.md).

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
-- messages holding one of its slots and those parked for one; how many keys it has
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
              AND m.read_ct > 0 AND m.visible_at > pg_catalog.now() AND m.due_at IS NULL),
           (SELECT pg_catalog.count(*) FROM {schema}.message AS m
            WHERE m.climit = l.name AND m.due_at IS NOT NULL),
           (SELECT pg_catalog.count(*) FROM {schema}.flow_state AS s WHERE s.limiter = l.name)
    FROM {schema}.flow_limit AS l
    WHERE wanted IS NULL OR l.name = wanted
    ORDER BY l.name
$$;

REVOKE ALL ON FUNCTION {schema}.flow_limit_states(text) FROM PUBLIC;

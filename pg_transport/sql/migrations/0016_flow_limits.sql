-- 0016: global rate limits and concurrency per key (docs/design/flow-control.md, the
-- gates `rate` and `slots` of the claim). A limit is a row of flow_limit; the claim reads
-- the definitions at every claim, so a change takes effect without restarting anyone.
-- What a message asks for is read from its headers by the claim (task, pgq-rate-key,
-- pgq-concurrency-key...), never from columns a publisher writes: a publisher gets no new
-- right, and a message cannot name one task in a column and run as another.

-- A limit: a rate (count per period in seconds, with a burst) and/or a concurrency.
-- Named task:<task name>, queue:<queue name>, or by the user (a limiter several tasks
-- share). origin: written from configuration at worker start, or by `pgq limit set`
-- (which configuration does not overwrite until `pgq limit reset`).
CREATE TABLE {schema}.flow_limit (
    name        text        PRIMARY KEY,
    rate_count  integer,
    rate_period float8,
    burst       integer     NOT NULL DEFAULT 1,
    concurrency integer,
    origin      text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT flow_limit_rate_check CHECK ((rate_count IS NULL) = (rate_period IS NULL)
        AND (rate_count IS NULL OR (rate_count > 0 AND rate_period > 0
                                    AND rate_period < 'infinity'::float8))),
    CONSTRAINT flow_limit_burst_check CHECK (burst >= 1),
    CONSTRAINT flow_limit_concurrency_check CHECK (concurrency IS NULL OR concurrency >= 1),
    CONSTRAINT flow_limit_some_check CHECK (rate_count IS NOT NULL OR concurrency IS NOT NULL),
    CONSTRAINT flow_limit_origin_check CHECK (origin IN ('config', 'command')),
    CONSTRAINT flow_limit_name_check CHECK (pg_catalog.octet_length(name) BETWEEN 1 AND 200)
);

-- One row per limiter and key in use: the rate's theoretical arrival time (GCRA), and
-- the row a claim locks to count a key's slots. key is '' for a limiter without keys.
CREATE TABLE {schema}.flow_state (
    limiter text        NOT NULL,
    key     text        NOT NULL,
    tat     timestamptz NOT NULL DEFAULT '-infinity',
    used_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT flow_state_pkey PRIMARY KEY (limiter, key)
);

-- The limiter and key a claim granted a slot of (or parked the message for), written by
-- the claim only: the slots in use are counted from these rows, never from a counter, so
-- a crashed worker's slot comes back when its lease lapses.
ALTER TABLE {schema}.message ADD COLUMN climit text, ADD COLUMN ckey text;

-- The messages of a key that hold a slot or may (not parked): counted by flow_slots().
CREATE INDEX message_slot_live_idx ON {schema}.message (climit, ckey)
    WHERE climit IS NOT NULL AND visible_at < 'infinity'::timestamptz;
-- The messages of a key waiting for a slot, earliest first: promoted by flow_leave().
CREATE INDEX message_slot_wait_idx ON {schema}.message (climit, ckey, due_at)
    WHERE climit IS NOT NULL AND due_at IS NOT NULL;

-- GCRA: how many of want messages bucket (limiter, key) grants now, and when its next
-- token is due. Locks the bucket's row (SKIP LOCKED: another claim has it: granted -1,
-- busy) and moves its arrival time by what it grants, in the claim's transaction: the
-- next claimer of the bucket waits for nothing and reads this one's move. The time is
-- the server's clock when the lock is held, so grants are ordered as the lock is taken.
-- Invariant: a bucket never grants more than burst + elapsed / T in any interval.
-- VOLATILE and SECURITY INVOKER (the claim runs as the workers' role), search_path pinned.
CREATE FUNCTION {schema}.flow_tokens(limiter text, bucket text, want integer)
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
    wait text;
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
        -- The bucket's first use: its row, without waiting for another claim that is
        -- inserting it too (lock_timeout: that claim has the bucket; busy).
        wait := pg_catalog.current_setting('lock_timeout');
        PERFORM pg_catalog.set_config('lock_timeout', '1ms', true);
        BEGIN
            INSERT INTO {schema}.flow_state (limiter, key) VALUES (limiter, bucket)
            ON CONFLICT DO NOTHING;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
        PERFORM pg_catalog.set_config('lock_timeout', wait, true);
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

-- Slots: how many of want messages of (limiter, key) may start now, and the earliest
-- lease end of those in flight. Locks the key's row (SKIP LOCKED: busy, -1) and only
-- then counts, in a statement of its own and so in a fresh snapshot that includes every
-- claim that held the lock before (the claim's own snapshot would miss a claim that
-- committed after it began). The lock is held to the claim's commit. The holders are
-- counted twice, all and those it can share-lock: when the two differ a holder is being
-- acked, released or renewed right now, and the key is busy. The share locks make a
-- holder's removal wait for this claim's commit, so its trigger (flow_leave) sees what
-- this claim parked.
CREATE FUNCTION {schema}.flow_slots(limiter text, bucket text, want integer)
RETURNS TABLE (granted integer, next_at timestamptz)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cap integer;
    live integer;
    locked integer;
    ends timestamptz;
    wait text;
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
        -- The key's first use: as in flow_tokens.
        wait := pg_catalog.current_setting('lock_timeout');
        PERFORM pg_catalog.set_config('lock_timeout', '1ms', true);
        BEGIN
            INSERT INTO {schema}.flow_state (limiter, key) VALUES (limiter, bucket)
            ON CONFLICT DO NOTHING;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
        PERFORM pg_catalog.set_config('lock_timeout', wait, true);
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

-- After a message that held or waited for a slot left the table: the key's earliest
-- waiting message is made visible now (its place kept) and its queue woken, so a freed
-- slot is taken within one claim, not at the parked message's time. A waiting message
-- another claim holds is skipped: that claim looks at the key again itself.
CREATE FUNCTION {schema}.flow_leave() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    woken text;
BEGIN
    UPDATE {schema}.message AS m
    SET visible_at = LEAST(m.due_at, pg_catalog.now()), due_at = NULL
    WHERE m.id = (SELECT w.id FROM {schema}.message AS w
                  WHERE w.climit = OLD.climit AND w.ckey = OLD.ckey AND w.due_at IS NOT NULL
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

CREATE TRIGGER message_leave_slot AFTER DELETE ON {schema}.message
FOR EACH ROW WHEN (OLD.climit IS NOT NULL) EXECUTE FUNCTION {schema}.flow_leave();

-- flow_tokens and flow_slots keep EXECUTE for PUBLIC: they run as the caller, who needs
-- the worker's table rights for them to do anything, so any role a claim runs as (one
-- granted tables only, as pgq's refusal hints say) claims with or without limits. The
-- trigger function runs as the owner and is the trigger's alone.
REVOKE ALL ON FUNCTION {schema}.flow_leave() FROM PUBLIC;

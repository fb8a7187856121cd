-- Named queries of `pgq limit`: the flow limits (docs/flow-control.md) shown and set at
-- run time. Each block starts with "-- name: <name>" and a one-line description;
-- {schema} is composed as an identifier, values are bound. The claim reads the
-- definitions at every claim: what is set here holds from the next claim on.

-- name: limit_list
-- Every limit (or the one named): its definition, the tokens its keyless bucket has now,
-- the messages holding one of its slots and those parked for one, how many keys it has
-- state for. Through flow_limit_states() (0018: runs as the owner and returns no key),
-- so the monitor role lists limits as the workers' role does.
SELECT s.name, s.rate_count, s.rate_period, s.burst, s.concurrency, s.origin, s.updated_at,
       s.tokens, s.in_flight, s.waiting, s.keys
FROM {schema}.flow_limit_states(%(name)s::text) AS s

-- name: limit_keys_allowed
-- Whether this role may read the keys of the limits (SELECT on flow_state: the workers'
-- role; keys are the application's values, which the monitor role does not read).
SELECT pg_catalog.has_table_privilege(
           pg_catalog.format('%%I.flow_state', %(schema)s::text), 'SELECT')

-- name: limit_set
-- Define or change a limit from the command (origin command, which configuration does
-- not overwrite until `pgq limit reset`). A part not given (NULL) keeps its value; a
-- cleared part is given as clear_rate / clear_concurrency. A changed rate starts its
-- buckets full (their arrival times were counted in the old interval). Returns the new
-- definition.
-- The row proposed for insertion keeps the parts not given too: its CHECKs are tested
-- before the conflict is found, so a change of burst alone must not propose a limit
-- with neither a rate nor a concurrency.
WITH old AS (
    SELECT l.rate_count, l.rate_period, l.burst, l.concurrency FROM {schema}.flow_limit AS l
    WHERE l.name = %(name)s::text
), set AS (
    INSERT INTO {schema}.flow_limit AS l
        (name, rate_count, rate_period, burst, concurrency, origin)
    SELECT %(name)s::text,
           CASE WHEN %(rate_count)s::integer IS NULL
                THEN (SELECT old.rate_count FROM old) ELSE %(rate_count)s::integer END,
           CASE WHEN %(rate_count)s::integer IS NULL
                THEN (SELECT old.rate_period FROM old) ELSE %(rate_period)s::float8 END,
           COALESCE(%(burst)s::integer, (SELECT old.burst FROM old), 1),
           COALESCE(%(concurrency)s::integer, (SELECT old.concurrency FROM old)), 'command'
    ON CONFLICT (name) DO UPDATE
    SET rate_count = CASE WHEN %(clear_rate)s::boolean THEN NULL
                          ELSE COALESCE(EXCLUDED.rate_count, l.rate_count) END,
        rate_period = CASE WHEN %(clear_rate)s::boolean THEN NULL
                           ELSE COALESCE(EXCLUDED.rate_period, l.rate_period) END,
        burst = COALESCE(%(burst)s::integer, l.burst),
        concurrency = CASE WHEN %(clear_concurrency)s::boolean THEN NULL
                           ELSE COALESCE(EXCLUDED.concurrency, l.concurrency) END,
        origin = 'command', updated_at = pg_catalog.now()
    RETURNING l.name, l.rate_count, l.rate_period, l.burst, l.concurrency, l.origin
), refilled AS (
    UPDATE {schema}.flow_state AS s SET tat = '-infinity'
    FROM set
    WHERE s.limiter = set.name
      AND NOT EXISTS (SELECT FROM old
                      WHERE (old.rate_count, old.rate_period, old.burst)
                            IS NOT DISTINCT FROM (set.rate_count, set.rate_period, set.burst))
)
SELECT * FROM set

-- name: limit_release
-- After a change: every message a gate parked until a time (due_at kept) is made
-- visible now, its queue woken, so a raised limit serves them at once. Safe for any
-- parked message: every gate judges it again at its next claim. A scan of the message
-- table, once per command.
WITH woken AS (
    UPDATE {schema}.message AS m
    SET visible_at = LEAST(m.due_at, pg_catalog.now()), due_at = NULL
    WHERE m.due_at IS NOT NULL AND m.visible_at > pg_catalog.now()
      AND m.visible_at < 'infinity'::timestamptz
    RETURNING m.queue
)
SELECT q.queue, pg_catalog.pg_notify(
           %(channel_prefix)s::text || pg_catalog.md5(pg_catalog.convert_to(q.queue, 'UTF8')),
           '')
FROM (SELECT DISTINCT woken.queue FROM woken) AS q

-- name: limit_reset
-- Remove a limit set by the command (or any, with every_origin): configuration writes
-- its own again at the next worker start. The origin removed, or nothing.
DELETE FROM {schema}.flow_limit AS l
WHERE l.name = %(name)s AND (l.origin = 'command' OR %(every_origin)s::boolean)
RETURNING l.origin

-- name: limit_keys
-- The keys of a limiter with most waiting: tokens of each key's bucket now, messages
-- holding a slot, messages parked for one. At most n.
SELECT s.key,
       CASE WHEN l.rate_count IS NOT NULL THEN GREATEST(0, LEAST(l.burst,
           pg_catalog.floor(((l.burst - 1) * l.rate_period / l.rate_count
               - EXTRACT(EPOCH FROM GREATEST(s.tat, pg_catalog.statement_timestamp())
                         - pg_catalog.statement_timestamp())::float8)
               / (l.rate_period / l.rate_count) + 1e-9)::integer + 1)) END AS tokens,
       (SELECT pg_catalog.count(*) FROM {schema}.message AS m
        WHERE m.climit = s.limiter AND m.ckey = s.key
          AND m.visible_at < 'infinity'::timestamptz
          AND m.read_ct > 0 AND m.visible_at > pg_catalog.now() AND m.due_at IS NULL)
           AS in_flight,
       (SELECT pg_catalog.count(*) FROM {schema}.message AS m
        WHERE m.climit = s.limiter AND m.ckey = s.key AND m.due_at IS NOT NULL) AS waiting,
       s.used_at
FROM {schema}.flow_state AS s
JOIN {schema}.flow_limit AS l ON l.name = s.limiter
WHERE s.limiter = %(name)s
ORDER BY waiting DESC, in_flight DESC, s.used_at DESC, s.key
LIMIT %(n)s

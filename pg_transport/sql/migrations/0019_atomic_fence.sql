-- 0019: an atomic task's fence as a function, sent with the run's COMMIT in one round
-- trip (docs/design/exactly-once.md, "The fence at the commit").

-- End one delivery in the calling transaction, fenced as an ack is (row id, lease,
-- queue), and only in the transaction the run began (xid: pg_current_xact_id() as the
-- run's open read it). Refused with a pgq SQLSTATE, which aborts the transaction, so the
-- COMMIT sent after it in the same round trip becomes a rollback:
--   PQ001: no such row (the lease lapsed; the message is another delivery's);
--   PQ002: another transaction (the task committed or rolled back the run's itself).
-- The row's triggers release its ordering key and record its end for followers, visible
-- at that commit. SECURITY INVOKER: the caller deletes with its own rights (a worker's
-- DELETE on message); EXECUTE stays with PUBLIC, as it writes nothing its caller may not.
CREATE FUNCTION {schema}.atomic_complete(id bigint, lease integer, queue text, xid text)
RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF pg_catalog.pg_current_xact_id()::text IS DISTINCT FROM xid THEN
        RAISE EXCEPTION USING ERRCODE = 'PQ002',
            MESSAGE = 'pgq: the atomic run''s transaction ended before its commit',
            DETAIL = pg_catalog.format('message %s of queue %L', id, queue);
    END IF;
    DELETE FROM {schema}.message AS m
    WHERE m.id = atomic_complete.id AND m.lease = atomic_complete.lease
      AND m.queue = atomic_complete.queue;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PQ001',
            MESSAGE = 'pgq: the atomic run''s lease lapsed',
            DETAIL = pg_catalog.format('message %s of queue %L', id, queue);
    END IF;
END
$$;

-- 0012: a key's order is its commit order, and never two messages of a key at once
-- (docs/design/ordering.md, "Commit order").
-- A keyed message's place (oseq) is taken at insert; a message inserted earlier but
-- committed later (an application's transaction, a batch) would come first in its key,
-- even ahead of a message of the key already delivered. At commit, a deferred trigger
-- moves such a message to the back of its key (a fresh oseq), behind every message of the
-- key another transaction committed first. Two commits of one key at the same moment
-- may still end up in either order, and one with the earlier place may become visible
-- while the other is delivered: the claim then sees the key busy (a message of it in
-- flight, or being claimed by another session) and does not deliver it (claim in
-- queries.sql). Such a message is parked until the lease of the one in flight ends
-- (a finite park): the leave trigger promotes a key's parked head, finite or not.

-- The messages of a key that are not parked: the claim looks for one in flight.
CREATE INDEX message_key_live_idx ON {schema}.message (queue, okey)
    WHERE okey IS NOT NULL AND visible_at < 'infinity'::timestamptz;

-- At the commit of a keyed message: to the back of its key if a message of the key with
-- a later place is there that is not this transaction's own later one (inserted after
-- it, not moved yet), unless it holds the place of the message it retries (strict).
-- Own messages of a key move in the order they were inserted: one moved makes every
-- later one move too, so the transaction's own order is kept. At most 64 later places
-- are read: past that, the message moves (always safe).
CREATE FUNCTION {schema}.message_commit_place() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    later bigint;
    counted bigint;
    twin boolean;
BEGIN
    -- One statement: the later places (latest first, at most 64), those that count, and
    -- whether a retry's original holds this place. Nothing when the row is gone.
    SELECT pg_catalog.count(l.id),
           pg_catalog.count(l.id) FILTER (WHERE l.id < NEW.id OR NOT l.xmin = me.xmin),
           (SELECT true FROM {schema}.message AS o
            WHERE o.queue = NEW.queue AND o.okey = NEW.okey AND o.oseq = NEW.oseq
              AND o.id <> NEW.id LIMIT 1)
    INTO later, counted, twin
    FROM (SELECT m.xmin FROM {schema}.message AS m WHERE m.id = NEW.id) AS me
    LEFT JOIN LATERAL (SELECT o.id, o.xmin FROM {schema}.message AS o
                       WHERE o.queue = NEW.queue AND o.okey = NEW.okey AND o.oseq > NEW.oseq
                       ORDER BY o.oseq DESC LIMIT 64) AS l ON true;
    IF twin IS NULL AND (counted > 0 OR later >= 64) THEN
        UPDATE {schema}.message
        SET oseq = pg_catalog.nextval('{schema}.message_oseq'::regclass)
        WHERE id = NEW.id;
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER message_commit_place AFTER INSERT ON {schema}.message
DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW WHEN (NEW.okey IS NOT NULL) EXECUTE FUNCTION {schema}.message_commit_place();

REVOKE ALL ON FUNCTION {schema}.message_commit_place() FROM PUBLIC;

-- A move at commit is not a move of a message anyone saw: only a delivered one's
-- (relaxed requeue) promotes its key's next.
DROP TRIGGER message_move_key ON {schema}.message;
CREATE TRIGGER message_move_key AFTER UPDATE OF oseq ON {schema}.message
FOR EACH ROW WHEN (OLD.okey IS NOT NULL AND OLD.oseq IS DISTINCT FROM NEW.oseq
                   AND OLD.read_ct > 0)
EXECUTE FUNCTION {schema}.message_leave();

-- A key's parked head is promoted whether parked for good or until a lease ends.
CREATE OR REPLACE FUNCTION {schema}.message_leave() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    woken integer := 0;
BEGIN
    IF OLD.okey IS NOT NULL THEN
        UPDATE {schema}.message AS m
        SET visible_at = COALESCE(m.due_at, pg_catalog.now()), due_at = NULL
        WHERE m.id = (SELECT h.id FROM {schema}.message AS h
                      WHERE h.queue = OLD.queue AND h.okey = OLD.okey
                      ORDER BY h.oseq, h.id LIMIT 1)
          AND m.due_at IS NOT NULL;
        GET DIAGNOSTICS woken = ROW_COUNT;
        IF woken > 0 THEN
            PERFORM pg_catalog.pg_notify(
                {channel_prefix}::text || pg_catalog.md5(pg_catalog.convert_to(OLD.queue, 'UTF8')),
                '');
        END IF;
    END IF;
    IF TG_OP = 'DELETE' AND OLD.task_id IS NOT NULL THEN
        IF OLD.followable OR EXISTS (SELECT 1 FROM {schema}.message AS f
                                     WHERE f.follows = OLD.task_id) THEN
            INSERT INTO {schema}.follow_done (task_id, queue) VALUES (OLD.task_id, OLD.queue)
            ON CONFLICT (task_id) DO UPDATE
            SET queue = EXCLUDED.queue, finished_at = EXCLUDED.finished_at;
            WITH woke AS (
                UPDATE {schema}.message AS f
                SET visible_at = COALESCE(f.due_at, pg_catalog.now()), due_at = NULL
                WHERE f.follows = OLD.task_id AND f.due_at IS NOT NULL
                  AND f.visible_at > pg_catalog.now()
                  AND f.visible_at < 'infinity'::timestamptz
                RETURNING f.queue
            )
            SELECT pg_catalog.count(*) INTO woken FROM (
                SELECT pg_catalog.pg_notify(
                    {channel_prefix}::text
                    || pg_catalog.md5(pg_catalog.convert_to(w.queue, 'UTF8')), '')
                FROM (SELECT DISTINCT woke.queue FROM woke) AS w
            ) AS n;
        END IF;
    END IF;
    RETURN NULL;
END
$$;

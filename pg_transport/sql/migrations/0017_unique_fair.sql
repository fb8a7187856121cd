-- 0017: unique tasks (docs/design/flow-control.md, "Unique tasks: at the publish").
-- A message may carry a uniqueness key: while a row holds it, no other row may. The key
-- is a column of the message row, so whatever removes the row (ack, dead-letter, expiry,
-- purge, queue deletion) releases it, and a crash releases nothing (the row is still
-- there, or comes back). urun: held while running too (unique_while="queued_or_running");
-- otherwise the claim that delivers the message clears its key.
ALTER TABLE {schema}.message
    ADD COLUMN ukey text,
    ADD COLUMN urun boolean NOT NULL DEFAULT false;

-- Partial: a plain message (ukey NULL) adds no entry, at its publish nor at its claims.
CREATE UNIQUE INDEX message_unique_idx ON {schema}.message (ukey) WHERE ukey IS NOT NULL;

-- Who holds a unique key, for a publish that inserted nothing: the holder's task id, or,
-- when no row holds the key, the task id of the row this publish already inserted (its
-- publish key: a publish sent again after an ambiguous commit, whose message was claimed
-- since). NULL: nobody (the holder left between the conflict and this look-up; the publish
-- is sent once more). Runs as the owner (a publisher may not read messages) and returns a
-- task id only. VOLATILE: each look-up reads in a snapshot of its own, taken after the
-- insert waited for the holder's transaction.
CREATE FUNCTION {schema}.unique_holder(key text, own_publish_key text) RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    holder text;
BEGIN
    SELECT COALESCE(m.task_id, '') INTO holder FROM {schema}.message AS m WHERE m.ukey = key;
    IF holder IS NULL THEN
        SELECT COALESCE(m.task_id, '') INTO holder FROM {schema}.message AS m
        WHERE m.publish_key = own_publish_key;
    END IF;
    RETURN holder;
END
$$;

REVOKE ALL ON FUNCTION {schema}.unique_holder(text, text) FROM PUBLIC;

-- Before a unique message is inserted: a Celery retry (the same task id, published while
-- the delivered original still holds the key with unique_while="queued_or_running") takes
-- the key over from the original, in the transaction that publishes it, so the retry is
-- not refused as a duplicate of itself and the key is never free in between. A publish
-- sent again (the same publish key) or a message not delivered yet (read_ct = 0) keeps
-- its key: that conflict is the index's to find.
CREATE FUNCTION {schema}.message_unique_pass() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE {schema}.message AS m SET ukey = NULL
    WHERE m.ukey = NEW.ukey AND m.task_id = NEW.task_id AND m.read_ct > 0
      AND m.publish_key IS DISTINCT FROM NEW.publish_key;
    RETURN NEW;
END
$$;

CREATE TRIGGER message_unique_pass BEFORE INSERT ON {schema}.message
FOR EACH ROW WHEN (NEW.ukey IS NOT NULL AND NEW.task_id IS NOT NULL)
EXECUTE FUNCTION {schema}.message_unique_pass();

REVOKE ALL ON FUNCTION {schema}.message_unique_pass() FROM PUBLIC;

-- Fair share (docs/design/flow-control.md, "Fair share"): a queue in fair mode is claimed
-- round-robin over its messages' fair keys. A message's fkey is set at its publish only
-- in a fair queue (its header's key, or '' without one), so the partial index holds
-- exactly the fair queues' messages: a plain message adds no entry, at its publish nor
-- at its claims.
ALTER TABLE {schema}.queue ADD COLUMN fair boolean NOT NULL DEFAULT false;
ALTER TABLE {schema}.message ADD COLUMN fkey text;

-- A fair queue's keys in order, each key's ready messages first (claim_pick_fair).
CREATE INDEX message_fair_idx ON {schema}.message (queue, fkey, visible_at, id)
    WHERE fkey IS NOT NULL;

-- Where the last claim of a fair queue stopped: the next walks from the key after it.
CREATE TABLE {schema}.fair_cursor (
    queue text PRIMARY KEY,
    after text NOT NULL
);

-- 0011: ordered delivery per key, and "follows" (docs/ordering.md).
-- A message published with an ordering key (okey) is delivered only once no earlier
-- message of its key and queue remains: oseq is its place in the key (publish order; a
-- retry of a message still held takes that message's place in a strict queue). A claim
-- that meets a message with an earlier one of its key still there parks it: visible_at
-- becomes 'infinity' (after every ready row in the claim index, so no claim reads it
-- again) and due_at keeps when it would have been visible. The row that leaves its key
-- (acked, dead-lettered, expired, purged, or moved to the back of its key) promotes the
-- key's new head, by trigger: whatever statement removed it.
-- A follower names a task (follows) it must not run before: a claim parks it until
-- follow_until while that task is still queued or unknown; when the task's message
-- leaves the table its end is recorded in follow_done and its parked followers are made
-- visible. Past follow_until a follower runs anyway and is told its predecessor was not
-- seen to finish.

ALTER TABLE {schema}.message
    ADD COLUMN okey text,
    ADD COLUMN oseq bigint,
    ADD COLUMN due_at timestamptz,
    ADD COLUMN task_id text,
    ADD COLUMN follows text,
    ADD COLUMN follow_until timestamptz,
    ADD COLUMN followable boolean NOT NULL DEFAULT false;

-- Places in keys; shared by every queue.
CREATE SEQUENCE {schema}.message_oseq AS bigint;

-- A key's messages in order: its head is the first entry.
CREATE INDEX message_key_idx ON {schema}.message (queue, okey, oseq, id) WHERE okey IS NOT NULL;
-- Messages a follower may name (they carry their task id), and the followers.
CREATE INDEX message_task_idx ON {schema}.message (task_id) WHERE task_id IS NOT NULL;
CREATE INDEX message_follows_idx ON {schema}.message (follows) WHERE follows IS NOT NULL;

-- What a failure does to the rest of a key: strict (NULL: never configured) keeps a
-- released message and a retry first; relaxed sends them to the back of the key.
ALTER TABLE {schema}.queue ADD COLUMN ordering text;
ALTER TABLE {schema}.queue ADD CONSTRAINT queue_ordering_check
    CHECK (ordering IN ('strict', 'relaxed'));

-- Tasks that left the message table while a follower named them (or that were published
-- followable): a follower claimed later knows its predecessor ran. Reaped by
-- housekeeping after follows_retention.
CREATE TABLE {schema}.follow_done (
    task_id     text        PRIMARY KEY,
    queue       text        NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX follow_done_finished_idx ON {schema}.follow_done (finished_at);

-- Before a keyed message is inserted: its place in the key. Runs as the schema's owner
-- (a publisher may insert messages but not read them), with a pinned search_path.
CREATE FUNCTION {schema}.message_place() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.task_id IS NOT NULL
       AND COALESCE((SELECT q.ordering FROM {schema}.queue AS q WHERE q.name = NEW.queue),
                    'strict') = 'strict' THEN
        -- A retry of a message of its key still there (same task): that message's place.
        SELECT m.oseq INTO NEW.oseq FROM {schema}.message AS m
        WHERE m.task_id = NEW.task_id AND m.queue = NEW.queue AND m.okey = NEW.okey
        ORDER BY m.oseq LIMIT 1;
    END IF;
    IF NEW.oseq IS NULL THEN
        NEW.oseq := pg_catalog.nextval('{schema}.message_oseq'::regclass);
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER message_place BEFORE INSERT ON {schema}.message
FOR EACH ROW WHEN (NEW.okey IS NOT NULL) EXECUTE FUNCTION {schema}.message_place();

-- After a keyed or followable message left the table (or moved to the back of its key):
-- promote its key's head if parked, record the task's end for followers, wake them. Each
-- statement here sees what committed before it began: a claim that parked a message
-- behind this one held a lock this row's removal waited for, so the park is seen.
CREATE FUNCTION {schema}.message_leave() RETURNS trigger
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
          AND m.visible_at = 'infinity'::timestamptz;
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

CREATE TRIGGER message_leave_key AFTER DELETE ON {schema}.message
FOR EACH ROW WHEN (OLD.okey IS NOT NULL OR OLD.task_id IS NOT NULL)
EXECUTE FUNCTION {schema}.message_leave();

CREATE TRIGGER message_move_key AFTER UPDATE OF oseq ON {schema}.message
FOR EACH ROW WHEN (OLD.okey IS NOT NULL AND OLD.oseq IS DISTINCT FROM NEW.oseq)
EXECUTE FUNCTION {schema}.message_leave();

REVOKE ALL ON FUNCTION {schema}.message_place() FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.message_leave() FROM PUBLIC;

-- 0015: the publisher's boundary says once which queues are the workers'. message_admit()
-- judges both tables' inserts by a role that may not move messages: a worker's control
-- or reply queue (kombu pidbox) or an event receiver's (celeryev) is refused as a message
-- and as a dead letter, and a message's columns are judged as 0013 did. One trigger
-- function rather than a boolean function both call: a function called inside a trigger
-- is checked for EXECUTE as the inserting role, which would give the publisher role one
-- more function than result_read (docs/least-privilege.md). The refusals still name the
-- trigger (message_admit, dead_letter_admit), as the publisher's error handling expects.

CREATE OR REPLACE FUNCTION {schema}.message_admit() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem text;
BEGIN
    -- A worker's control or reply queue (kombu pidbox) or an event receiver's (celeryev):
    -- refused as a message, and as a dead letter, which an operator's `pgq dead requeue`
    -- (as the workers' role) would deliver.
    IF NEW.queue LIKE '%.pidbox' OR NEW.queue LIKE 'celeryev.%' THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', CONSTRAINT = TG_NAME,
            MESSAGE = pg_catalog.format(
                'role %I may publish task messages only, not to %L: a worker''s control or '
                'reply queue (kombu pidbox) or an event queue (celeryev) takes messages '
                'from the workers'' role only', current_user, NEW.queue);
    END IF;
    IF TG_TABLE_NAME = 'dead_letter' THEN
        -- A dead letter's columns are not a claim's: nothing else to judge.
        RETURN NEW;
    END IF;
    problem := CASE
        -- What only a claim writes.
        WHEN NEW.read_ct <> 0 THEN 'read_ct must be 0'
        WHEN NEW.lease <> 0 THEN 'lease must be 0'
        WHEN NEW.oseq IS NOT NULL THEN 'oseq is given by pgq'
        WHEN NEW.due_at IS NOT NULL THEN 'due_at is set by a claim'
        WHEN NEW.enqueued_at <> pg_catalog.now() THEN 'enqueued_at must be now()'
        -- The times a claim waits on, within the bounds a publish keeps
        -- (pg_transport.message.ordering: MAX_KEY_HOLD, MAX_FOLLOWS_TIMEOUT).
        WHEN NEW.visible_at < pg_catalog.now() THEN 'visible_at must not be before now()'
        WHEN NOT pg_catalog.isfinite(NEW.visible_at) THEN 'visible_at must be a finite time'
        WHEN NEW.okey IS NOT NULL
             AND NEW.visible_at > pg_catalog.now() + interval '1 day'
            THEN 'visible_at of a message with an ordering key must be within 1 day of '
                 'now(): it holds every later message of its key until then'
        WHEN NEW.follows IS NOT NULL AND NEW.follow_until IS NULL
            THEN 'follow_until must be set on a follower (follows)'
        WHEN NOT pg_catalog.isfinite(NEW.follow_until) THEN 'follow_until must be a finite time'
        WHEN NEW.follow_until > NEW.visible_at + interval '365 days'
            THEN 'follow_until must be within 365 days of visible_at'
        WHEN NEW.okey IS NOT NULL AND NEW.follow_until > pg_catalog.now() + interval '1 day'
            THEN 'follow_until of a message with an ordering key must be within 1 day of '
                 'now(): it holds every later message of its key until then'
    END;
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', CONSTRAINT = TG_NAME,
            MESSAGE = pg_catalog.format(
                'role %I may not insert this message into queue %L: %s',
                current_user, NEW.queue, problem);
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER dead_letter_admit ON {schema}.dead_letter;

CREATE TRIGGER dead_letter_admit BEFORE INSERT ON {schema}.dead_letter
FOR EACH ROW
WHEN (NOT pg_catalog.has_column_privilege('{schema}.message'::regclass, 'visible_at', 'UPDATE'))
EXECUTE FUNCTION {schema}.message_admit();

DROP FUNCTION {schema}.dead_letter_admit();

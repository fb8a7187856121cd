-- 0013: the publisher's boundary, kept by the database (docs/least-privilege.md,
-- docs/security.md). A role that may not move messages (no UPDATE of message.visible_at,
-- which a worker's claim needs: a publisher-only role) inserts task messages and nothing
-- else: no row for a worker's control or reply queue (Celery's remote control: shutdown,
-- revoke, pool_restart, rate_limit), nor for an event receiver's; no value of a column
-- only a claim writes (read_ct, lease, a place in a key, when it was parked); and the
-- times a claim waits on within the bounds every pgq publish keeps (pg_transport.ordering):
-- a message of an ordering key holds its key for at most a day, a follower waits for at
-- most 365 days, nothing is due at an infinite time (a parked message's mark) or before
-- now. A role that may move messages is not bounded: it could write all of this anyway.
-- Not SECURITY DEFINER: current_user is the role that inserts, whose rights are judged.
-- Named to sort before message_place (triggers of one event fire in name order), so a
-- place in a key is judged as the inserting role gave it.

CREATE FUNCTION {schema}.message_admit() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem text;
BEGIN
    IF NEW.queue LIKE '%.pidbox' OR NEW.queue LIKE 'celeryev.%' THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', CONSTRAINT = TG_NAME,
            MESSAGE = pg_catalog.format(
                'role %I may publish task messages only, not to %L: a worker''s control or '
                'reply queue (kombu pidbox) or an event queue (celeryev) takes messages '
                'from the workers'' role only', current_user, NEW.queue);
    END IF;
    problem := CASE
        -- What only a claim writes.
        WHEN NEW.read_ct <> 0 THEN 'read_ct must be 0'
        WHEN NEW.lease <> 0 THEN 'lease must be 0'
        WHEN NEW.oseq IS NOT NULL THEN 'oseq is given by pgq'
        WHEN NEW.due_at IS NOT NULL THEN 'due_at is set by a claim'
        WHEN NEW.enqueued_at <> pg_catalog.now() THEN 'enqueued_at must be now()'
        -- The times a claim waits on, within the bounds a publish keeps
        -- (pg_transport.ordering: MAX_KEY_HOLD, MAX_FOLLOWS_TIMEOUT).
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

-- Only for a role that may not move messages: one that may (a worker's claim updates
-- visible_at) could write all of this anyway, and its inserts call no function at all.
CREATE TRIGGER message_admit BEFORE INSERT ON {schema}.message
FOR EACH ROW
WHEN (NOT pg_catalog.has_column_privilege('{schema}.message'::regclass, 'visible_at', 'UPDATE'))
EXECUTE FUNCTION {schema}.message_admit();

-- A dead letter is requeued by an operator (`pgq dead requeue`, as the workers' role):
-- one a publisher-only role wrote for a control queue would reach a worker that way.
CREATE FUNCTION {schema}.dead_letter_admit() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.queue LIKE '%.pidbox' OR NEW.queue LIKE 'celeryev.%' THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', CONSTRAINT = TG_NAME,
            MESSAGE = pg_catalog.format(
                'role %I may publish task messages only, not to %L: a worker''s control or '
                'reply queue (kombu pidbox) or an event queue (celeryev) takes messages '
                'from the workers'' role only', current_user, NEW.queue);
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER dead_letter_admit BEFORE INSERT ON {schema}.dead_letter
FOR EACH ROW
WHEN (NOT pg_catalog.has_column_privilege('{schema}.message'::regclass, 'visible_at', 'UPDATE'))
EXECUTE FUNCTION {schema}.dead_letter_admit();

REVOKE ALL ON FUNCTION {schema}.message_admit() FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.dead_letter_admit() FROM PUBLIC;

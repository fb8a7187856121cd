-- The whole current schema of pgq. {schema} is composed as an identifier.
-- tests/integration/test_schema.py builds one database from this file and one
-- from migrations/ and diffs the catalogs: change both together.

CREATE TABLE {schema}.schema_version (
    version    integer     PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- A declared queue. Messages may exist for a queue that is not declared
-- (publishing to an undeclared queue keeps the message, as Redis does).
-- A queue unused (no consumer touching it) for expires_ms is deleted, as AMQP's
-- x-expires; message_ttl_ms bounds how long its messages live (x-message-ttl).
CREATE TABLE {schema}.queue (
    name           text        PRIMARY KEY,
    created_at     timestamptz NOT NULL DEFAULT now(),
    expires_ms     bigint,
    message_ttl_ms bigint,
    last_used      timestamptz NOT NULL DEFAULT now(),
    -- What a failure does to the rest of an ordering key (docs/ordering.md): strict
    -- (NULL: never configured) or relaxed.
    ordering       text,
    -- Claimed round-robin over its messages' fair keys (0017_unique_fair.sql).
    fair           boolean     NOT NULL DEFAULT false,
    CONSTRAINT queue_ordering_check CHECK (ordering IN ('strict', 'relaxed'))
);

CREATE INDEX queue_expiring_idx ON {schema}.queue (last_used) WHERE expires_ms IS NOT NULL;

-- Routing state shared by every process. pattern is the routing key as an
-- anchored regular expression (topic exchanges).
CREATE TABLE {schema}.exchange (
    name       text        PRIMARY KEY,
    type       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT exchange_type_check CHECK (type IN ('direct', 'topic', 'fanout'))
);

INSERT INTO {schema}.exchange (name, type) VALUES
    ('', 'direct'), ('amq.direct', 'direct'), ('amq.topic', 'topic'), ('amq.fanout', 'fanout');

CREATE TABLE {schema}.binding (
    exchange    text NOT NULL,
    queue       text NOT NULL,
    routing_key text NOT NULL,
    pattern     text NOT NULL,
    CONSTRAINT binding_pkey PRIMARY KEY (exchange, routing_key, queue)
);

CREATE INDEX binding_queue_idx ON {schema}.binding (queue);

-- A message is a row; visible_at is its visibility timeout. read_ct counts
-- deliveries (max_attempts); lease counts grants (every claim and every release) and
-- is the fencing token of acks, releases, renewals and dead-lettering: a holder whose
-- message was released or claimed again can touch it no more.
CREATE TABLE {schema}.message (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue       text        NOT NULL,
    priority    smallint    NOT NULL DEFAULT 0,
    visible_at  timestamptz NOT NULL DEFAULT now(),
    read_ct     integer     NOT NULL DEFAULT 0,
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    publish_key text,
    payload     json        NOT NULL,
    expires_at  timestamptz,
    lease       integer     NOT NULL DEFAULT 0,
    -- Ordering (0011_ordering.sql tells how): the key and the place in it; when a
    -- parked message would have been visible; the task id of a message a follower may
    -- name; the task a follower follows and how long it waits for it.
    okey         text,
    oseq         bigint,
    due_at       timestamptz,
    task_id      text,
    follows      text,
    follow_until timestamptz,
    followable   boolean     NOT NULL DEFAULT false,
    -- The limiter and key a claim granted a slot of, or parked the message for
    -- (0016_flow_limits.sql): written by the claim only.
    climit       text,
    ckey         text,
    -- Unique tasks (0017_unique_fair.sql tells how): the key no other row may hold while this
    -- one does, and whether it is held while the message runs too.
    ukey         text,
    urun         boolean     NOT NULL DEFAULT false,
    -- Fair share: the message's key in a fair queue ('' without one), NULL elsewhere.
    fkey         text,
    -- Whether it holds or waits for its queue's concurrency slot (0018_flow_reads.sql):
    -- written by the claim only, in a queue with such a limit.
    qslot        boolean     NOT NULL DEFAULT false,
    CONSTRAINT message_publish_key_key UNIQUE (publish_key),
    CONSTRAINT message_priority_check CHECK (priority BETWEEN 0 AND 255)
) WITH (
    -- Vacuumed once 10,000 rows are dead however small the table, unthrottled.
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0,
    -- Half of each page is left free: a claim's new version of a row (about 1 kB for
    -- a Celery message) stays on its page, and the WAL carries only what changed.
    -- Last, as migration 0006 leaves it in the table's options.
    fillfactor = 50
);

-- Claim order within a queue: priority first, then the time a message became visible
-- (published, due, released or its lease lapsed), then arrival. Rows in flight or
-- delayed sort after the ready ones of their priority, so a claim never reads them.
CREATE INDEX message_claim_idx ON {schema}.message (queue, priority DESC, visible_at, id);

CREATE INDEX message_expiring_idx ON {schema}.message (expires_at) WHERE expires_at IS NOT NULL;

-- Places in keys; shared by every queue.
CREATE SEQUENCE {schema}.message_oseq AS bigint;

-- A key's messages in order: its head is the first entry.
CREATE INDEX message_key_idx ON {schema}.message (queue, okey, oseq, id) WHERE okey IS NOT NULL;
-- The messages of a key that are not parked: the claim looks for one in flight
-- (0012_commit_order.sql).
CREATE INDEX message_key_live_idx ON {schema}.message (queue, okey)
    WHERE okey IS NOT NULL AND visible_at < 'infinity'::timestamptz;
-- Messages a follower may name (they carry their task id), and the followers.
CREATE INDEX message_task_idx ON {schema}.message (task_id) WHERE task_id IS NOT NULL;
CREATE INDEX message_follows_idx ON {schema}.message (follows) WHERE follows IS NOT NULL;

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

CREATE TRIGGER message_leave_key AFTER DELETE ON {schema}.message
FOR EACH ROW WHEN (OLD.okey IS NOT NULL OR OLD.task_id IS NOT NULL)
EXECUTE FUNCTION {schema}.message_leave();

-- A move of a delivered message to the back of its key (relaxed requeue) promotes the
-- key's next; a move at commit (message_commit_place) is of a message no one saw.
CREATE TRIGGER message_move_key AFTER UPDATE OF oseq ON {schema}.message
FOR EACH ROW WHEN (OLD.okey IS NOT NULL AND OLD.oseq IS DISTINCT FROM NEW.oseq
                   AND OLD.read_ct > 0)
EXECUTE FUNCTION {schema}.message_leave();

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

REVOKE ALL ON FUNCTION {schema}.message_place() FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.message_leave() FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.message_commit_place() FROM PUBLIC;

-- Before any message or dead letter is inserted: the publisher's boundary. A role that
-- may not move messages (a publisher-only role) inserts task messages only, with nothing
-- a claim alone writes and the times a claim waits on within their bounds
-- (0013_publish_boundary.sql); one function for both tables, so which queues are the
-- workers' is said once (0015_admit_once.sql).
-- Not SECURITY DEFINER: current_user is the role that inserts, whose rights are judged.
-- Named to sort before message_place: a place in a key is judged as the role gave it.
CREATE FUNCTION {schema}.message_admit() RETURNS trigger
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

-- Only for a role that may not move messages: one that may (a worker's claim updates
-- visible_at) could write all of this anyway, and its inserts call no function at all.
CREATE TRIGGER message_admit BEFORE INSERT ON {schema}.message
FOR EACH ROW
WHEN (NOT pg_catalog.has_column_privilege('{schema}.message'::regclass, 'visible_at', 'UPDATE'))
EXECUTE FUNCTION {schema}.message_admit();

REVOKE ALL ON FUNCTION {schema}.message_admit() FROM PUBLIC;

-- Unique tasks (0017_unique_fair.sql).
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

-- Fair share (0017_unique_fair.sql).
-- A fair queue's keys in order, each key's ready messages first (claim_pick_fair).
CREATE INDEX message_fair_idx ON {schema}.message (queue, fkey, visible_at, id)
    WHERE fkey IS NOT NULL;

-- Where the last claim of a fair queue stopped: the next walks from the key after it.
CREATE TABLE {schema}.fair_cursor (
    queue text PRIMARY KEY,
    after text NOT NULL
);

-- Poisoned, rejected and undecodable messages. Never silently deleted.
CREATE TABLE {schema}.dead_letter (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id  bigint      NOT NULL,
    queue       text        NOT NULL,
    priority    smallint    NOT NULL DEFAULT 0,
    read_ct     integer     NOT NULL,
    enqueued_at timestamptz NOT NULL,
    dead_at     timestamptz NOT NULL DEFAULT now(),
    reason      text        NOT NULL,
    task_id     text,
    task_name   text,
    identity    jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    hooks       jsonb       NOT NULL DEFAULT '[]'::jsonb,
    payload     json        NOT NULL
);

CREATE INDEX dead_letter_queue_idx ON {schema}.dead_letter (queue, id);

-- A dead letter is requeued by an operator (`pgq dead requeue`, as the workers' role):
-- one a publisher-only role wrote for a control queue would reach a worker that way.
-- Judged by message_admit(), which knows the queues; its refusal names this trigger.
CREATE TRIGGER dead_letter_admit BEFORE INSERT ON {schema}.dead_letter
FOR EACH ROW
WHEN (NOT pg_catalog.has_column_privilege('{schema}.message'::regclass, 'visible_at', 'UPDATE'))
EXECUTE FUNCTION {schema}.message_admit();

-- A fan-in barrier. remaining counts the parts not finished yet; the part that
-- takes it to 0 flips armed -> fired and inserts the callback message in the
-- same transaction. callback/errback are Celery signatures (JSON).
CREATE TABLE {schema}.barrier (
    id            text        PRIMARY KEY,
    status        text        NOT NULL DEFAULT 'armed',
    total         integer     NOT NULL,
    remaining     integer     NOT NULL,
    callback      json        NOT NULL,
    errback       json,
    metadata      jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    reason        text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    progressed_at timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL,
    stuck_timeout interval    NOT NULL,
    fired_at      timestamptz,
    finished_at   timestamptz,
    CONSTRAINT barrier_status_check
        CHECK (status IN ('armed', 'fired', 'completed', 'failed', 'expired')),
    CONSTRAINT barrier_remaining_check CHECK (remaining BETWEEN 0 AND total)
);

-- The sweep only ever looks at armed barriers.
CREATE INDEX barrier_armed_idx ON {schema}.barrier (expires_at) WHERE status = 'armed';

-- One row per finished part: the primary key is what makes a redelivered part
-- unable to count twice.
CREATE TABLE {schema}.barrier_part (
    barrier_id  text        NOT NULL REFERENCES {schema}.barrier (id) ON DELETE CASCADE,
    idx         integer     NOT NULL,
    task_id     text,
    outcome     text        NOT NULL,
    result      json,
    finished_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT barrier_part_pkey PRIMARY KEY (barrier_id, idx),
    CONSTRAINT barrier_part_outcome_check CHECK (outcome IN ('succeeded', 'failed'))
);

-- Guards: a claim with a lease. completed_at set = tombstone, never re-claimed;
-- token counts (re)claims and fences renew/complete/release of a stale holder.
CREATE TABLE {schema}.guard_claim (
    key          text        PRIMARY KEY,
    holder       text        NOT NULL,
    token        bigint      NOT NULL DEFAULT 1,
    lease_until  timestamptz NOT NULL,
    claimed_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz
);

-- Guards: a generation counter per key; every replace bumps it.
CREATE TABLE {schema}.guard_generation (
    key        text        PRIMARY KEY,
    generation bigint      NOT NULL,
    bumped_at  timestamptz NOT NULL DEFAULT now()
);

-- Periodic tasks (pg_transport.beat). A schedule entry: its schedule as JSON
-- ({{"every": seconds, "aligned": bool}} or {{"crontab": "m h dom mon dow"}}); its slots
-- are the times it falls due, counted from anchor. last_due is the latest slot sent (or
-- passed over): a slot is sent only if later, by the transaction that moves it, so two
-- beats can never both send one. revision counts the changes a sender must have seen.
CREATE TABLE {schema}.beat_entry (
    name         text        PRIMARY KEY,
    task         text        NOT NULL,
    schedule     jsonb       NOT NULL,
    args         jsonb       NOT NULL DEFAULT '[]'::jsonb,
    kwargs       jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    options      jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    enabled      boolean     NOT NULL DEFAULT true,
    origin       text        NOT NULL,
    anchor       timestamptz NOT NULL DEFAULT now(),
    revision     bigint      NOT NULL DEFAULT 1,
    last_due     timestamptz,
    last_sent_at timestamptz,
    sent_count   bigint      NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT beat_entry_origin_check CHECK (origin IN ('config', 'command'))
);

-- One row per slot sent: the primary key is what makes a slot impossible to send twice,
-- whatever the number of beats. Inserted in the transaction that inserts the message.
CREATE TABLE {schema}.beat_slot (
    entry   text        NOT NULL,
    due_at  timestamptz NOT NULL,
    task_id text        NOT NULL,
    sent_at timestamptz NOT NULL DEFAULT now(),
    sent_by text        NOT NULL,
    CONSTRAINT beat_slot_pkey PRIMARY KEY (entry, due_at)
);

CREATE INDEX beat_slot_due_idx ON {schema}.beat_slot (due_at);

-- The beat that does the work: one row, a lease its holder renews. Leadership only
-- saves work (the others stay idle); slots stay single whoever sends them.
CREATE TABLE {schema}.beat_leader (
    singleton   boolean     PRIMARY KEY DEFAULT true,
    holder      text        NOT NULL,
    term        bigint      NOT NULL DEFAULT 1,
    lease_until timestamptz NOT NULL,
    acquired_at timestamptz NOT NULL,
    renewed_at  timestamptz NOT NULL,
    CONSTRAINT beat_leader_singleton_check CHECK (singleton)
);

-- The web console's history (`pgq web`): one tick per sampling interval, taken by
-- whichever console inserts it first (the primary key makes the tick single however many
-- consoles run), with the message table's cumulative inserted and deleted row counts
-- (Postgres' statistics) from which the charts' rates are computed.
CREATE TABLE {schema}.console_tick (
    at        timestamptz PRIMARY KEY,
    taken_at  timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    inserted  bigint,
    deleted   bigint
);

-- Per queue and tick: the figures of `pgq status`. Kept for an hour and a bit.
CREATE TABLE {schema}.console_sample (
    at               timestamptz NOT NULL
                                 REFERENCES {schema}.console_tick (at) ON DELETE CASCADE,
    queue            text        NOT NULL,
    ready            bigint      NOT NULL,
    in_flight        bigint      NOT NULL,
    delayed          bigint      NOT NULL,
    dead             bigint      NOT NULL,
    oldest_ready_age float8,
    CONSTRAINT console_sample_pkey PRIMARY KEY (at, queue)
);

-- The result backend (result_backend = "pgq://…").
-- A task's state is one row keyed by its id: the meta Celery stores (status, result,
-- traceback, children, task_extended fields) encoded with the result serializer,
-- possibly compressed, with its content type so a reader decodes what a writer wrote.
-- status, date_done and expires_at are columns so that SQL can judge a row without
-- decoding it: a SUCCESS is never overwritten, expired rows are reaped by index.
CREATE TABLE {schema}.result (
    task_id          text        PRIMARY KEY,
    status           text        NOT NULL,
    content_type     text        NOT NULL,
    content_encoding text        NOT NULL,
    meta             bytea       NOT NULL,
    date_done        timestamptz,
    expires_at       timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX result_expiring_idx ON {schema}.result (expires_at) WHERE expires_at IS NOT NULL;

-- A saved GroupResult (GroupResult.save / restore).
CREATE TABLE {schema}.result_group (
    group_id         text        PRIMARY KEY,
    content_type     text        NOT NULL,
    content_encoding text        NOT NULL,
    meta             bytea       NOT NULL,
    expires_at       timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX result_group_expiring_idx ON {schema}.result_group (expires_at)
    WHERE expires_at IS NOT NULL;

-- Results are read, forgotten and grouped by id only, through these functions: a role
-- allowed them (a publisher waiting for its tasks) reaches the results whose ids it
-- holds and cannot list any other. A role that could read the table could learn a
-- chord's header ids and group id, and publish a part of that chord under one of those
-- ids, which a worker would run and count (a SUCCESS is never replaced, so the forged
-- value would stand). Each runs as the owner, with names resolved in pg_catalog only.
CREATE FUNCTION {schema}.result_read(ids text[])
RETURNS TABLE (task_id text, status text, content_type text, content_encoding text,
               meta bytea, updated_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT r.task_id, r.status, r.content_type, r.content_encoding, r.meta, r.updated_at
    FROM {schema}.result AS r
    WHERE r.task_id = ANY(ids)
$$;

CREATE FUNCTION {schema}.result_forget(id text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM {schema}.result AS r WHERE r.task_id = id
$$;

-- Saving a group again replaces it (GroupResult.save).
CREATE FUNCTION {schema}.result_group_save(
    id text, content_type text, content_encoding text, meta bytea, expires float8
) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO {schema}.result_group AS g
        (group_id, content_type, content_encoding, meta, expires_at)
    VALUES (id, content_type, content_encoding, meta,
            pg_catalog.now() + pg_catalog.make_interval(secs => expires))
    ON CONFLICT (group_id) DO UPDATE
    SET content_type = excluded.content_type,
        content_encoding = excluded.content_encoding,
        meta = excluded.meta,
        expires_at = excluded.expires_at
$$;

CREATE FUNCTION {schema}.result_group_read(id text)
RETURNS TABLE (content_type text, content_encoding text, meta bytea)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT g.content_type, g.content_encoding, g.meta
    FROM {schema}.result_group AS g
    WHERE g.group_id = id
$$;

CREATE FUNCTION {schema}.result_group_delete(id text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM {schema}.result_group AS g WHERE g.group_id = id
$$;

-- Postgres lets PUBLIC execute a new function: these are granted by name
-- (docs/least-privilege.md, docs/results.md).
REVOKE ALL ON FUNCTION {schema}.result_read(text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.result_forget(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.result_group_save(text, text, text, bytea, float8) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.result_group_read(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.result_group_delete(text) FROM PUBLIC;

-- Flow control (0016_flow_limits.sql, docs/design/flow-control.md).
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

-- The messages of a key that hold a slot or may (not parked): counted by flow_slots().
CREATE INDEX message_slot_live_idx ON {schema}.message (climit, ckey)
    WHERE climit IS NOT NULL AND visible_at < 'infinity'::timestamptz;
-- The messages of a key waiting for a slot, earliest first: promoted by flow_leave().
CREATE INDEX message_slot_wait_idx ON {schema}.message (climit, ckey, due_at)
    WHERE climit IS NOT NULL AND due_at IS NOT NULL;

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

-- What the monitor may read of unique tasks and flow limits (0018_flow_reads.sql).
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

-- Whole-queue concurrency (docs/flow-control.md): the limit queue:<name> with a
-- concurrency holds at most that many of the queue's messages leased at once. A message
-- holds (or waits for) its queue's slot when qslot is true, written by the claim only,
-- and only in a queue with such a limit: every other message adds no index entry.
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

-- An atomic task's fence, sent with its run's COMMIT (0019_atomic_fence.sql).
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

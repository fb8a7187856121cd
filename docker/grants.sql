-- The workers', publishers' and monitor's rights: blocks 4, 5 and 6 of
-- docs/least-privilege.md, run by the compose file's `grants` service as the owner
-- after every `pgq migrate` (a column a new version adds is granted to no one until
-- they run again; running them again changes nothing else).
-- tests/unit/test_compose.py checks the statements are the page's;
-- tests/acceptance/test_compose.py runs this file.

-- 4. worker rights, as pgq_owner
GRANT USAGE ON SCHEMA pgq TO pgq_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA pgq TO pgq_worker;
ALTER DEFAULT PRIVILEGES FOR ROLE pgq_owner IN SCHEMA pgq
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO pgq_worker;
-- The result backend reads, forgets and keeps groups through these (by id).
GRANT EXECUTE ON FUNCTION pgq.result_read(text[]), pgq.result_forget(text),
      pgq.result_group_save(text, text, text, bytea, float8), pgq.result_group_read(text),
      pgq.result_group_delete(text)
    TO pgq_worker;
-- A duplicate unique task's publish asks who holds its key (a task id, nothing else).
GRANT EXECUTE ON FUNCTION pgq.unique_holder(text, text) TO pgq_worker;
-- `pgq status` counts the unique keys held; `pgq limit list` reads the limits' figures.
GRANT EXECUTE ON FUNCTION pgq.unique_counts(), pgq.flow_limit_states(text) TO pgq_worker;

-- 5. monitor rights, as pgq_owner
BEGIN;
-- Start from nothing: a table-wide SELECT (what this page granted before) reads payloads.
REVOKE ALL ON ALL TABLES IN SCHEMA pgq FROM pgq_monitor;
ALTER DEFAULT PRIVILEGES FOR ROLE pgq_owner IN SCHEMA pgq REVOKE ALL ON TABLES FROM pgq_monitor;
GRANT USAGE ON SCHEMA pgq TO pgq_monitor;
GRANT SELECT ON pgq.schema_version, pgq.queue TO pgq_monitor;
-- Where each message is and since when; of an ordered message, its key (an id of your
-- application's, not content), counted as keys blocked, and what tells a follower parked.
GRANT SELECT (id, queue, priority, visible_at, read_ct, enqueued_at,
              okey, due_at, follow_until, climit, qslot)
    ON pgq.message TO pgq_monitor;
-- The flow limits' definitions (flow-control.md); their keys are not granted.
GRANT SELECT ON pgq.flow_limit TO pgq_monitor;
-- Counts that need rows the monitor may not read, computed by the owner's functions:
-- the unique keys held per queue (never a key), and each limit's tokens and number of
-- keys (`pgq limit list`, never a key).
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pgq FROM pgq_monitor;
GRANT EXECUTE ON FUNCTION pgq.unique_counts(), pgq.flow_limit_states(text) TO pgq_monitor;
GRANT SELECT (id, queue, priority, read_ct, enqueued_at, dead_at)
    ON pgq.dead_letter TO pgq_monitor;
GRANT SELECT (id, status, total, remaining, created_at, progressed_at, expires_at,
              stuck_timeout, fired_at, finished_at)
    ON pgq.barrier TO pgq_monitor;
-- The web console's samples (counts only), read by a console run as the monitor.
GRANT SELECT ON pgq.console_tick, pgq.console_sample TO pgq_monitor;
COMMIT;

-- 6. publisher rights, as pgq_owner
BEGIN;
REVOKE ALL ON ALL TABLES IN SCHEMA pgq FROM pgq_publisher;
ALTER DEFAULT PRIVILEGES FOR ROLE pgq_owner IN SCHEMA pgq REVOKE ALL ON TABLES FROM pgq_publisher;
GRANT USAGE ON SCHEMA pgq TO pgq_publisher;
-- The schema's version, checked at connect.
GRANT SELECT (version) ON pgq.schema_version TO pgq_publisher;
-- A message; its publish key is read by ON CONFLICT, so a resent publish inserts nothing.
GRANT INSERT (queue, priority, visible_at, publish_key, payload, expires_at,
              okey, task_id, follows, follow_until, followable, ukey, urun, fkey),
      SELECT (publish_key)
    ON pgq.message TO pgq_publisher;
-- A duplicate unique task's publish asks who holds its key: a task id, never a row.
GRANT EXECUTE ON FUNCTION pgq.unique_holder(text, text) TO pgq_publisher;
-- Routing, read only: a routed publish finds its queues in one statement.
GRANT SELECT (name, type) ON pgq.exchange TO pgq_publisher;
GRANT SELECT (exchange, queue, routing_key, pattern) ON pgq.binding TO pgq_publisher;
GRANT SELECT (name, message_ttl_ms, fair) ON pgq.queue TO pgq_publisher;
-- A direct message no queue is bound to receive is kept as a dead letter.
GRANT INSERT (message_id, queue, priority, read_ct, enqueued_at, reason, payload),
      SELECT (id)
    ON pgq.dead_letter TO pgq_publisher;
COMMIT;

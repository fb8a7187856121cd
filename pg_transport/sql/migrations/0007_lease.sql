-- 0007: wake-ups say only "look", and a lease fences every holder.
-- A consumer is no longer handed messages in NOTIFY payloads: any role that can connect
-- may LISTEN and NOTIFY on any channel, so a notification can carry nothing a consumer
-- trusts. Publishes notify their queue's own channel with an empty payload and the
-- consumer claims; the waiter table of the hand-off is dropped. Workers of the previous
-- version write it in every claim: stop them before this runs.
-- lease counts the grants of a message (every claim and every release): the token that
-- fences ack, release, renew and dead-lettering. read_ct still counts deliveries (for
-- max_attempts), but a release did not change it, so a holder whose message was
-- released kept a valid token: its late renew hid the requeued message for a whole
-- visibility timeout and its late ack deleted it unrun. A message in flight during the
-- upgrade keeps its token: lease starts equal to read_ct.

DROP TABLE IF EXISTS {schema}.waiter;

ALTER TABLE {schema}.message ADD COLUMN lease integer NOT NULL DEFAULT 0;

UPDATE {schema}.message SET lease = read_ct WHERE read_ct <> 0;

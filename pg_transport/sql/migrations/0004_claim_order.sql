-- 0004: claim in order of visibility ("first visible, first served") within a priority.
-- The claim index used to end in id: leased and delayed rows (visible_at in the
-- future) sat at its head and every claim stepped over them one heap fetch at a time,
-- so claiming slowed down with the number of messages in flight. With visible_at in
-- the index the ready rows of a priority come first and invisible ones are never read.
-- The price: claims and renewals change an indexed column and are no longer HOT
-- updates, which the benchmarks show costs nothing measurable.

DROP INDEX {schema}.message_claim_idx;

CREATE INDEX message_claim_idx ON {schema}.message (queue, priority DESC, visible_at, id);

-- Autovacuum, where it runs, vacuums this table once 10,000 rows are dead however small
-- the table is (the default waits for a fifth of it), and unthrottled: the table stays
-- small, and every dead row at the head of the claim index slows every claim.
ALTER TABLE {schema}.message SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0
);

-- 0004: claim in order of visibility ("first visible, first served") within a priority.
-- The claim index used to end in id: leased and delayed rows (visible_at in the
-- future) sat at its head and every claim stepped over them one heap fetch at a time,
-- so claiming slowed down with the number of messages in flight. With visible_at in
-- the index the ready rows of a priority come first and invisible ones are never read.
-- The price: claims and renewals change an indexed column and are no longer HOT
-- updates, which the benchmarks show costs nothing measurable.

DROP INDEX {schema}.message_claim_idx;

CREATE INDEX message_claim_idx ON {schema}.message (queue, priority DESC, visible_at, id);

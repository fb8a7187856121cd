-- 0006: leave half of each page of the message table free (fill factor 50, was 90).
-- A claim rewrites its row (visible_at and read_ct change). A Celery message's row is
-- about 1 kB, more than the tenth of a page that 90 left free, so the new version
-- always went to another page and the WAL carried the whole payload again. With half
-- the page free it stays on its page and the WAL carries only what changed: draining a
-- backlog writes about 0.4 times the WAL per message, every message's whole passage
-- about 0.7 times (benchmarks/table_health.py, docs/performance.md). The price is
-- space: a backlog at rest takes about twice the pages. Only pages written from now
-- on are filled to the new factor.

ALTER TABLE {schema}.message SET (fillfactor = 50);

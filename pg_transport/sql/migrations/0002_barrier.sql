-- 0002: the fan-in barrier and the guard primitives (claims, generations).

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

-- Index task queue, version 2: what the fair claim and the operator's requeue need.

-- Fair claim across tenants of a tier: the claim walks the tenants that have due work with
-- a skip scan over this index (one probe per tenant) and takes each tenant's oldest due
-- tasks from it. Partial on the claimable-by-time states only, like index_task_due: a
-- table full of SUCCEEDED/DEAD rows adds nothing to it, and RUNNING rows (whose heartbeats
-- must stay HOT updates) are not in it either.
CREATE INDEX index_task_due_by_tenant ON index_task (tier, tenant_id, next_attempt_at)
    WHERE status IN ('PENDING', 'RETRY_WAIT');

-- Whose turn it is within a claim round: every claim takes the next value and starts the
-- round-robin over the tier's tenants there. A sequence never blocks and never rolls back,
-- so concurrent claimers do not serialise on it (a counter row would).
CREATE SEQUENCE index_task_claim_turn AS bigint CYCLE;

-- Operators requeue DEAD tasks; every requeue is kept: who, when, what the task looked like
-- and whether its attempt budget was renewed. Failures stay data an operator can query.
CREATE TABLE index_task_requeue (
    requeue_id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id              uuid        NOT NULL REFERENCES index_task (task_id),
    requeued_by          text        NOT NULL CHECK (length(requeued_by) BETWEEN 1 AND 200),
    requeued_at          timestamptz NOT NULL,
    reset_attempts       boolean     NOT NULL,
    attempts             integer     NOT NULL,
    previous_max_attempts integer    NOT NULL,
    new_max_attempts     integer     NOT NULL,
    previous_error_code  text,
    previous_error_message text
);
CREATE INDEX index_task_requeue_task ON index_task_requeue (task_id, requeued_at);

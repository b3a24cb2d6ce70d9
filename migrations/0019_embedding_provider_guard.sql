-- The embedding provider's shared guard (issue 27; services/embedding/guard/): one limiter
-- and one circuit breaker per provider key, shared by every worker of every process, so
-- fifty workers on one API key behave as one client. Rows are created on demand by the
-- guard (INSERT .. ON CONFLICT DO NOTHING); a provider never used has none.
--
-- `provider` is a provider key (services/embedding/guard/identity.py), e.g.
-- `openai:https://api.openai.com/v1#text-embedding-3-small`: no secret is ever part of it.

-- One row per provider: the pause a 429's Retry-After asked for, and the breaker.
-- opened_at/open_until stay while half open: a failed probe reopens for twice that span.
CREATE TABLE embedding_provider_state (
    provider             text PRIMARY KEY,
    paused_until         timestamptz,
    breaker_state        text NOT NULL DEFAULT 'closed'
                         CHECK (breaker_state IN ('closed', 'open', 'half_open')),
    consecutive_failures integer NOT NULL DEFAULT 0 CHECK (consecutive_failures >= 0),
    opened_at            timestamptz,
    open_until           timestamptz,
    probe_owner          text,
    probe_until          timestamptz,
    last_failure_code    text,
    last_success_at      timestamptz,
    updated_at           timestamptz NOT NULL DEFAULT now(),
    CHECK (breaker_state <> 'open' OR open_until IS NOT NULL),
    CHECK (breaker_state <> 'half_open' OR (probe_owner IS NOT NULL AND probe_until IS NOT NULL))
);

-- One row per quota bucket of a provider (`requests`, `tokens`, `indexing:requests`,
-- `indexing:tokens`, `tenant:<id>:tokens`): its GCRA theoretical arrival time. The rates
-- are configuration, not stored. Updated once per embedding request while a rate is set:
-- room on each page for the new row version keeps the updates HOT (tat is in no index).
CREATE TABLE embedding_quota_bucket (
    provider text NOT NULL,
    bucket   text NOT NULL,
    tat      timestamptz NOT NULL,
    PRIMARY KEY (provider, bucket)
) WITH (fillfactor = 50);

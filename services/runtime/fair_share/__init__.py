"""Fair shares between tenants (docs/architecture.md#fair-shares): one tenant's flood of
searches or publishes must not slow every other tenant down.

After tenant authentication and before any work, each search and publish request passes
its tenant's share in this process: a cap on the tenant's requests in flight and,
when its tier sets a rate, a token bucket. Beyond either it is answered 429 with a stable
code and a ``Retry-After``. A search then holds one of the process's search slots while it
reads -- taken once any wait for a read replica is over, given back before its answer is
written -- handed out to the waiting tenant running the fewest searches, so a quiet
tenant's search waits behind at most one running search, however many another tenant has
queued; a search that finds no slot within ``KB_FAIR_SEARCH_SLOT_WAIT_SECONDS`` is
answered 429 too. Between the phases of a search (the query's embedding, the database's
lists) a busier tenant's search hands its slot to the quieter tenant's, which so waits for
one phase, not a whole search.

- ``settings.py``: ``KB_FAIR_*``, the limits of each tier;
- ``bucket.py``: the token bucket; ``shares.py``: each tenant's requests in flight and
  buckets, forgotten once idle; ``slots.py``: the process's search slots and their queue;
  ``phases.py``: when a search holds its slot, and the boundaries between its phases, where
  it may change hands;
- ``tiers.py``: the tenant's tier, cached; ``gate.py``: the three composed;
  ``middleware.py``: the ASGI middleware ``services/app.py`` installs;
  ``metrics.py``: refusals and slot waits.
"""

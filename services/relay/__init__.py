"""The relay service: committed outbox rows to Kafka, in commit order, never skipping one.

- ``relay.py``: the loop (supervisor + one driver per leased partition), domain only.
- ``ports.py``: what it needs (``OutboxSource``, ``LeaseStore``, ``EventSink``, ``Wakeups``).
- ``outbox_pg.py`` + ``queries.sql``: PostgreSQL (snapshot windows, leases, LISTEN); the
  module docstring explains why the reading technique cannot skip a row.
- ``sink_kafka.py``: aiokafka, idempotent, acks=all, topic creation.
- ``replay.py``: re-send a range marked ``replay=true``; ``cli.py``: ``kb relay run|replay``.
"""

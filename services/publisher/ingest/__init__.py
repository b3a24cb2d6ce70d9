"""Publish by event (docs/architecture.md#publish-by-event): `kb ingest run --tier T` applies
signed commands from ``kb.ingest.<tier>`` in the publish's own transaction.

Rooms, bottom up: ``commands`` (the commands and their decoding), ``signing`` (Ed25519),
``settings``, ``ports``, ``metrics`` < ``apply`` (one command, one transaction, recorded
once) < ``store_pg`` (its PostgreSQL adapter), ``process`` (verify, apply or dead-letter one
record) < ``consumer_kafka`` (the aiokafka loop, offsets after the transaction) < ``cli``.
"""

"""Publish by event (docs/architecture.md#publish-by-event): `kb ingest run --tier T` applies
signed commands from ``kb.ingest.<tier>`` in the publish's own transaction.

Rooms, bottom up: ``commands`` (the commands and their decoding), ``signing`` (Ed25519),
``settings``, ``metrics`` < ``ports``, ``key_cache`` (keys kept a short while) < ``apply``
(one command's steps, recorded once) < ``runs`` (a tenant's run of commands in one
transaction, each in a savepoint; new documents written together), ``store_pg`` (the
PostgreSQL adapter), ``retention`` (refusal and command records' horizons) < ``process``
(verify, apply or dead-letter records) < ``consumer_kafka`` (the Kafka clients) <
``pipeline`` (lanes per tenant, read-ahead, offsets after the transactions) < ``cli``.
"""

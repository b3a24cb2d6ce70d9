"""Events: their vocabulary, Avro encoding, the outbox writer and the Kafka client arguments."""

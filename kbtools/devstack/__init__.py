"""`kb dev up|down|status`: embedded PostgreSQL + pgvector and a local Kafka broker."""

-- Connection set-up and clean-up (services/runtime/pg/db.py).

-- name: vector_type_exists
-- The vector type exists only after the first migration: a connection opened before it
-- (`kb migrate` itself, /readyz on an empty database) gets no vector codec.
SELECT EXISTS (SELECT 1 FROM pg_type WHERE typname = 'vector')

-- name: rollback
ROLLBACK

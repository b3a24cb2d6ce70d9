-- The sink COPYs a version's chunks straight into knowledge_chunk (issue 26): the temporary
-- staging table it created, filled and dropped in every completion cost more catalog work
-- than a short document's own insert. This table only gave that temporary table its shape
-- (CREATE TEMP TABLE ... LIKE) and was never written; nothing reads it any more.
DROP TABLE knowledge_chunk_staging;

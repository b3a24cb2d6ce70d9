-- Chunks of a large document on their way to the index (issue 9: indexer memory). A
-- document of more than a few thousand chunks is not held whole in the indexer: each slice
-- of its chunks, embedded, is written here under the attempt that made it (task_id +
-- lease_attempt, the task's fence), in a short transaction of its own that first checks the
-- lease (services/indexer/sink_stream.py). The fenced `complete` then moves the attempt's
-- rows into knowledge_chunk (INSERT .. SELECT .. ON CONFLICT DO NOTHING) and deletes every
-- row of the task, in the same transaction as the search pointer, SUCCEEDED and the outbox
-- event: the index itself is still written only under the fence, all or nothing.
--
-- Rows of an attempt that lost its lease or crashed are never read (a newer attempt reads
-- only its own) and are deleted by the task's next attempt when it starts staging, and by
-- its completion.
--
-- UNLOGGED: nothing here needs to survive a database crash (the table is then empty, the
-- completion finds fewer rows than the attempt staged and fails retriably, and the retry
-- streams the document again), and skipping WAL halves the cost of writing a chunk twice.
-- No foreign key to index_task: the slice transactions already lock the task row, and a
-- key check per row would only add to them.
CREATE UNLOGGED TABLE knowledge_chunk_stream (
    task_id         uuid    NOT NULL,
    lease_attempt   integer NOT NULL,
    chunk_id        text    NOT NULL,
    ordinal         integer NOT NULL,
    heading_path    text[]  NOT NULL,
    text            text    NOT NULL,
    content_digest  bytea   NOT NULL,
    embedding       vector  NOT NULL,
    PRIMARY KEY (task_id, lease_attempt, ordinal)
);

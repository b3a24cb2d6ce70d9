"""The approximate-nearest-neighbour index of one embedding model, and how queries name it.

``knowledge_chunk.embedding`` has no fixed dimension (model and dimension are part of the
index identity), so each model gets its own partial expression index:

    CREATE INDEX <ann_index_name(model)> ON [ONLY] knowledge_chunk
        USING hnsw (<vector_expression(dimension)> vector_cosine_ops)
        WHERE <model_predicate(model)>

``knowledge_chunk`` is partitioned by tenant (migrations/0014): the model's index, when the
indexers build it (KB_INDEXER_PARTITION_GRAPHS, off by default), is a partitioned index, one
HNSW graph per partition, built partition by partition (``build_ann_index_sql``). A large
tenant gets a graph of its own (``create_tenant_ann_index_sql``): the same
expression on its partition, the predicate narrowed to the tenant, which a query of that
tenant (the tenant a literal in its custom plan) prefers, being the smaller index.

A query uses that index only when it orders by the very same expression and its WHERE
implies the very same predicate, written as a literal: with a bind parameter a generic plan
could not prove the partial predicate and would scan. Hence the SQL text is specialised
per model (and cached), from these three functions, never from user input.
"""

from __future__ import annotations

import hashlib
import re

from services.runtime.tenancy.tenant_ids import TENANT_ID_PATTERN

# pgvector's HNSW indexes a `vector` of at most this many dimensions: CREATE INDEX over more
# fails, and CONCURRENTLY leaves an INVALID index behind.
HNSW_MAX_DIMENSION = 2000

_SAFE_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")


def check_model_name(model: str) -> str:
    if not _SAFE_MODEL.fullmatch(model):
        raise ValueError(
            f"embedding model name {model!r} has characters outside [A-Za-z0-9._:/@+-]"
        )
    return model


def ann_index_name(model: str) -> str:
    return (
        "knowledge_chunk_ann_" + hashlib.sha256(check_model_name(model).encode()).hexdigest()[:16]
    )


def vector_expression(dimension: int, column: str = "embedding") -> str:
    if not 0 < dimension <= 16000:
        raise ValueError(f"embedding dimension {dimension} out of range")
    return f"({column}::vector({int(dimension)}))"


def model_predicate(model: str, column: str = "embedding_model") -> str:
    # check_model_name admits no quote, so the literal needs no escaping.
    return f"{column} = '{check_model_name(model)}'"


_SAFE_PARTITION = re.compile(r"^knowledge_chunk_[a-z0-9_]{1,30}$")


def check_partition_name(partition: str) -> str:
    if not _SAFE_PARTITION.fullmatch(partition):
        raise ValueError(f"{partition!r} is not a partition name of knowledge_chunk")
    return partition


def partition_ann_index_name(model: str, partition: str) -> str:
    """The part of the model's ANN index on one partition: the model's index name and the
    partition's suffix (``knowledge_chunk_p07`` -> ``..._p07``)."""
    suffix = check_partition_name(partition).removeprefix("knowledge_chunk_")
    return f"{ann_index_name(model)}_{suffix}"


def _index_body(model: str, dimension: int) -> str:
    return (
        f" USING hnsw ({vector_expression(dimension)} vector_cosine_ops)"
        f" WHERE {model_predicate(model)}"
    )


def create_parent_ann_index_sql(model: str, dimension: int) -> str:
    """The model's ANN index on the partitioned table itself, and on it alone (ON ONLY): it
    stays INVALID, and unused, until every partition's part is attached. Instant."""
    return (
        f"CREATE INDEX IF NOT EXISTS {ann_index_name(model)} ON ONLY knowledge_chunk"
        + _index_body(model, dimension)
    )


def create_partition_ann_index_sql(
    model: str, dimension: int, partition: str, *, concurrently: bool = True
) -> str:
    """One partition's part of the model's ANN index; CONCURRENTLY (the sink's way) builds
    it without blocking writes, and must run outside a transaction."""
    how = "CONCURRENTLY " if concurrently else ""
    return (
        f"CREATE INDEX {how}IF NOT EXISTS {partition_ann_index_name(model, partition)}"
        f" ON {check_partition_name(partition)}" + _index_body(model, dimension)
    )


def attach_partition_ann_index_sql(model: str, partition: str) -> str:
    return (
        f"ALTER INDEX {ann_index_name(model)}"
        f" ATTACH PARTITION {partition_ann_index_name(model, partition)}"
    )


def drop_partition_ann_index_sql(model: str, partition: str) -> str:
    """Drops one partition's part (an INVALID leftover of an interrupted build)."""
    return f"DROP INDEX CONCURRENTLY IF EXISTS {partition_ann_index_name(model, partition)}"


def drop_ann_index_sql(model: str) -> str:
    """Drops the model's partitioned index and the parts attached to it. Not CONCURRENTLY
    (a partitioned index cannot be): it takes knowledge_chunk's ACCESS EXCLUSIVE lock, so
    the caller bounds its waits (indexer/sink/pgvector.PartitionedDrop)."""
    return f"DROP INDEX IF EXISTS {ann_index_name(model)}"


def build_ann_index_sql(
    model: str, dimension: int, partitions: list[str], *, concurrently: bool = True
) -> list[str]:
    """Every statement that builds the model's ANN index from nothing, in order: the parent,
    then each partition's part, built and attached (CREATE INDEX CONCURRENTLY cannot build a
    partitioned index in one go)."""
    statements = [create_parent_ann_index_sql(model, dimension)]
    for partition in partitions:
        statements.append(
            create_partition_ann_index_sql(model, dimension, partition, concurrently=concurrently)
        )
        statements.append(attach_partition_ann_index_sql(model, partition))
    return statements


_SAFE_TENANT = re.compile(TENANT_ID_PATTERN)


def check_tenant_name(tenant_id: str) -> str:
    if not _SAFE_TENANT.fullmatch(tenant_id):
        raise ValueError(f"{tenant_id!r} is not a tenant id")
    return tenant_id


def tenant_ann_index_name(model: str, tenant_id: str) -> str:
    """A tenant's own graph of the model: the model's index name and a digest of the tenant
    (a tenant id may be longer than an identifier has room for)."""
    digest = hashlib.sha256(check_tenant_name(tenant_id).encode()).hexdigest()[:16]
    return f"{ann_index_name(model)}_t{digest}"


def tenant_predicate(model: str, tenant_id: str) -> str:
    # Tenant ids are [a-z0-9-]: the literal needs no escaping.
    return f"{model_predicate(model)} AND tenant_id = '{check_tenant_name(tenant_id)}'"


def create_tenant_ann_index_sql(model: str, dimension: int, partition: str, tenant_id: str) -> str:
    """A tenant's own HNSW graph, on the partition holding it, built without blocking writes
    (outside a transaction). Not part of the model's partitioned index: a partial index on
    one partition, which the tenant's searches use because its predicate holds for them."""
    return (
        f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {tenant_ann_index_name(model, tenant_id)}"
        f" ON {check_partition_name(partition)}"
        f" USING hnsw ({vector_expression(dimension)} vector_cosine_ops)"
        f" WHERE {tenant_predicate(model, tenant_id)}"
    )


def drop_tenant_ann_index_sql(model: str, tenant_id: str) -> str:
    """Drops a tenant's graph (an INVALID leftover of an interrupted build)."""
    return f"DROP INDEX CONCURRENTLY IF EXISTS {tenant_ann_index_name(model, tenant_id)}"

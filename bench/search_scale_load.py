"""Loading the corpus of ``bench.search_latency`` into a database of its own, and building
its indexes; or reusing a database loaded before (``--reuse``: load and build once, measure
many times).

The load is COPY (binary vectors, as the sink writes them) in batches of 50,000 chunks.
The chunks' full-text GIN index is dropped for the load and built again afterwards from
its own definition (one build is much faster than 1M incremental GIN inserts); the rows'
triggers are off during the COPY (``session_replication_role = replica``: the foreign-key
checks and the trigger that copies the tenant's text search config, which is ``simple``,
the column's default, for every bench tenant). Then ``VACUUM ANALYZE`` and the model's
HNSW index, with ``maintenance_work_mem`` and parallel maintenance workers set for the
build. What the load measured is kept in a ``bench_meta`` table of the database.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import asyncpg
from pgvector.asyncpg import register_vector

from bench.databases import recreate_database, url_for
from bench.search_data import CHUNK_COLUMNS, PublishedRows, chunk_row
from bench.search_scale_corpus import (
    CORPUS_VERSION,
    DIMENSION,
    GROUPS,
    TENANTS,
    Corpus,
    document_uuid,
    tenant_name,
    text_batches,
    vector_batches,
)
from services.index.ann import ann_index_name, build_ann_index_sql
from services.indexer.sink.pgvector import QUERIES as SINK_QUERIES
from services.indexer.sink.tenant_graphs import PgTenantGraphs
from services.runtime.pg.migrations import apply_migrations
from services.runtime.tenancy.tenant_auth import hash_api_key

STRATEGY = "bench"
KEY_PREFIX_FOR_BENCH = "kb"
GIN_INDEX = "knowledge_chunk_search_document"
EXACT_INDEX = "knowledge_chunk_exact"


def api_key(tenant: str) -> str:
    """The bench tenant's API key (a well-formed key; only its hash is stored)."""
    return f"{KEY_PREFIX_FOR_BENCH}.{tenant}.bench-{hashlib.sha256(tenant.encode()).hexdigest()}"


def corpus_identity(corpus: Corpus, model: str) -> dict[str, Any]:
    return {
        "corpus_version": CORPUS_VERSION,
        "chunks": corpus.chunks,
        "seed": corpus.seed,
        "vectors": corpus.vectors,
        "model": model,
    }


async def reusable(admin_url: str, database: str, identity: dict[str, Any]) -> str | None:
    """Why ``database`` cannot be reused for ``identity`` (None: it can)."""
    try:
        conn = await asyncpg.connect(url_for(admin_url, database))
    except asyncpg.InvalidCatalogNameError:
        return f"database {database} does not exist"
    try:
        row = await conn.fetchval(
            "SELECT value FROM bench_meta WHERE key = 'identity'"
            " AND EXISTS (SELECT 1 FROM bench_meta WHERE key = 'built')"
        )
    except asyncpg.UndefinedTableError:
        return f"database {database} holds no bench corpus"
    finally:
        await conn.close()
    if row is None:
        return f"database {database}: its load or index build did not finish"
    if json.loads(row) != identity:
        return f"database {database} holds another corpus: {row}"
    return None


async def migrate(url: str) -> list[str]:
    """Applies the migrations a reused database lacks (a newer checkout's): it is measured
    with the schema the code expects. Returns the names of those applied."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SET statement_timeout = 0")
        result = await apply_migrations(conn)
        if result.applied:
            await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()
    return [m.name for m in result.applied]


async def meta(url: str) -> dict[str, Any]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT key, value FROM bench_meta")
    finally:
        await conn.close()
    return {r["key"]: json.loads(r["value"]) for r in rows}


async def _record(
    conn: asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any], key: str, value: Any
) -> None:
    await conn.execute(
        "INSERT INTO bench_meta (key, value) VALUES ($1, $2)"
        " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        key,
        json.dumps(value),
    )


async def load(
    admin_url: str,
    database: str,
    corpus: Corpus,
    model: str,
    *,
    maintenance_work_mem: str,
    parallel_workers: int,
    log: Any = print,
) -> str:
    """Creates ``database`` anew with the corpus and its indexes; returns its URL."""
    url = await recreate_database(admin_url, database)
    conn = await asyncpg.connect(url)
    try:
        await apply_migrations(conn)
        await register_vector(conn)
        await conn.execute("CREATE TABLE bench_meta (key text PRIMARY KEY, value jsonb NOT NULL)")
        await _record(conn, "identity", corpus_identity(corpus, model))
        await conn.execute("SET statement_timeout = 0")
        started = time.perf_counter()
        await _copy_tenants_and_documents(conn, corpus, model)
        # The full-text index and the exact vector list's (migrations/0017) are built once
        # after the load.
        gin_definition = await _dropped_index(conn, GIN_INDEX)
        exact_definition = await _dropped_index(conn, EXACT_INDEX)
        await conn.execute("SET session_replication_role = replica")
        copied = 0
        for vectors, (texts, headings) in zip(
            vector_batches(corpus), text_batches(corpus), strict=True
        ):
            await conn.copy_records_to_table(
                "knowledge_chunk",
                records=_chunk_rows(corpus, model, copied, vectors, texts, headings),
                columns=CHUNK_COLUMNS,
            )
            copied += len(texts)
            log(f"loaded {copied} chunks, {time.perf_counter() - started:.0f}s")
        await conn.execute("RESET session_replication_role")
        loaded = time.perf_counter() - started
        await _record(conn, "load_s", loaded)

        await conn.execute(f"SET maintenance_work_mem = '{maintenance_work_mem}'")
        await conn.execute(f"SET max_parallel_maintenance_workers = {int(parallel_workers)}")
        for definition, fact, what in (
            (gin_definition, "gin_build_s", "GIN index"),
            (exact_definition, "exact_build_s", "exact list's index"),
        ):
            started = time.perf_counter()
            await conn.execute(definition)
            await _record(conn, fact, time.perf_counter() - started)
            log(f"{what} built, {time.perf_counter() - started:.0f}s")
        started = time.perf_counter()
        await conn.execute("VACUUM ANALYZE")
        await _record(conn, "vacuum_analyze_s", time.perf_counter() - started)
        started = time.perf_counter()
        # The sink's DDL without CONCURRENTLY (nothing writes meanwhile): the same index,
        # partition by partition.
        partitions = [
            r["partition"] for r in await conn.fetch(SINK_QUERIES["knowledge_chunk_partitions"])
        ]
        for statement in build_ann_index_sql(model, DIMENSION, partitions, concurrently=False):
            await conn.execute(statement)
        await _record(conn, "hnsw_build_s", time.perf_counter() - started)
        log(f"HNSW index built, {time.perf_counter() - started:.0f}s")
        await conn.execute("ANALYZE knowledge_chunk")
        await _record(
            conn,
            "build_settings",
            {
                "maintenance_work_mem": maintenance_work_mem,
                "max_parallel_maintenance_workers": parallel_workers,
            },
        )
        sizes = await conn.fetchrow(
            # A partitioned table or index has no storage of its own: sum its partitions'.
            "SELECT (SELECT sum(pg_relation_size(relid))::bigint"
            "          FROM pg_partition_tree('knowledge_chunk')) AS heap,"
            " (SELECT sum(pg_total_relation_size(relid))::bigint"
            "    FROM pg_partition_tree('knowledge_chunk')) AS total,"
            " (SELECT sum(pg_relation_size(relid))::bigint"
            "    FROM pg_partition_tree(to_regclass($1))) AS hnsw,"
            " (SELECT sum(pg_relation_size(relid))::bigint"
            "    FROM pg_partition_tree(to_regclass($2))) AS gin,"
            " (SELECT sum(pg_relation_size(relid))::bigint"
            "    FROM pg_partition_tree(to_regclass($3))) AS exact",
            ann_index_name(model),
            GIN_INDEX,
            EXACT_INDEX,
        )
        assert sizes is not None
        await _record(conn, "sizes", dict(sizes))
        await _record(conn, "built", True)
    finally:
        await conn.close()
    return url


async def _dropped_index(conn: asyncpg.Connection[Any], name: str) -> str:
    """Drops index ``name`` of the partitioned table; returns the statement that builds it
    again. The partitioned index's definition reads "ON ONLY": without it, one statement
    builds every partition's part."""
    definition: str = await conn.fetchval("SELECT pg_get_indexdef(to_regclass($1))", name)
    await conn.execute(f"DROP INDEX {name}")
    return definition.replace(" ON ONLY ", " ON ")


async def _copy_tenants_and_documents(
    conn: asyncpg.Connection[Any], corpus: Corpus, model: str
) -> None:
    tenants = [tenant_name(t) for t in range(TENANTS)]
    await conn.executemany(
        "INSERT INTO tenant (tenant_id, tier) VALUES ($1, 'standard')", [(t,) for t in tenants]
    )
    await conn.executemany(
        "INSERT INTO tenant_api_key (key_id, tenant_id, key_hash)"
        " VALUES (gen_random_uuid(), $1, $2)",
        [(t, hash_api_key(api_key(t))) for t in tenants],
    )
    counts = corpus.document_chunks()
    rows = PublishedRows(model, STRATEGY)
    for d in range(corpus.documents):
        mask = int(corpus.document_groups[d])
        principals = ["group:everyone"]
        principals.extend(f"group:g{g:02d}" for g in range(GROUPS) if mask >> g & 1)
        if corpus.document_narrow[d]:
            principals.append("group:narrow")
        rows.add_document(
            tenant_name(int(corpus.document_tenant[d])),
            document_uuid(d),
            f"Document {d}",
            f"document {d}".encode(),
            principals,
            chunk_count=int(counts[d]),
        )
    await rows.copy(conn)


def _chunk_rows(
    corpus: Corpus,
    model: str,
    first: int,
    vectors: Any,
    texts: list[str],
    headings: list[list[str]],
) -> list[tuple[Any, ...]]:
    rows = []
    starts: dict[int, int] = {}
    for n, text in enumerate(texts):
        i = first + n
        d = int(corpus.chunk_document[i])
        ordinal = i - starts.setdefault(d, _document_start(corpus, d, i))
        rows.append(
            chunk_row(
                tenant_name(int(corpus.document_tenant[d])),
                document_uuid(d),
                model,
                STRATEGY,
                str(i),
                ordinal,
                headings[n],
                text,
                vectors[n],
            )
        )
    return rows


def _document_start(corpus: Corpus, d: int, i: int) -> int:
    while i > 0 and int(corpus.chunk_document[i - 1]) == d:
        i -= 1
    return i


async def build_tenant_graphs(
    url: str, model: str, *, min_chunks: int, maintenance_work_mem: str, log: Any = print
) -> None:
    """Each large tenant's own graph, as `kb indexer run` builds them (CONCURRENTLY, one
    tenant at a time); records the time and size when it built any (a reused database keeps
    its first figures)."""
    pool = await asyncpg.create_pool(url, min_size=1, max_size=1)
    try:
        started = time.perf_counter()
        graphs = PgTenantGraphs(
            pool, min_chunks=min_chunks, index_build_memory=maintenance_work_mem
        )
        built = await graphs.ensure(model, DIMENSION)
        if built:
            seconds = time.perf_counter() - started
            log(f"{len(built)} tenant graphs built, {seconds:.0f}s")
            async with pool.acquire() as conn:
                await _record(conn, "tenant_graphs_build_s", seconds)
                size = await conn.fetchrow(
                    "SELECT count(*) AS graphs, coalesce(sum(pg_relation_size(c.oid)), 0)::bigint"
                    " AS bytes FROM pg_class c WHERE c.relkind = 'i' AND c.relname LIKE $1",
                    ann_index_name(model) + "\\_t%",
                )
                assert size is not None
                await _record(conn, "tenant_graphs", dict(size) | {"min_chunks": min_chunks})
    finally:
        await pool.close()

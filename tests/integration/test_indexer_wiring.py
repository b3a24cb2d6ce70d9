"""How `kb indexer run` assembles its pipeline (services/indexer/wiring.py), on real
PostgreSQL: the settings reach the parts they configure."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from services.indexer.settings import IndexerSettings
from services.indexer.sink.pgvector import QUERIES as SINK_QUERIES
from services.indexer.wiring import pipeline_indexer
from services.runtime.settings import RuntimeSettings

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("partition_graphs", [True, False])
async def test_kb_indexer_partition_graphs_reaches_the_sink(
    settings: RuntimeSettings,
    pool: asyncpg.Pool[Any],
    monkeypatch: pytest.MonkeyPatch,
    partition_graphs: bool,
) -> None:
    """KB_INDEXER_PARTITION_GRAPHS=true: the model's partitioned HNSW index is built when
    the pipeline registers its generation at start; false (the default): none."""
    monkeypatch.setenv("KB_EMBEDDING_PROVIDER", "hashing")
    indexer_settings = IndexerSettings(
        database_url=settings.database_url,
        kafka_bootstrap_servers=settings.kafka_bootstrap_servers,
        indexer_partition_graphs=partition_graphs,
        indexer_parse_workers=1,
    )
    async with pipeline_indexer(indexer_settings, pool, slots=1, owner="test") as indexer:
        index = indexer.generation.ann_index_name
        built = await pool.fetchval(SINK_QUERIES["ann_index_state"], index)
    assert built is (True if partition_graphs else None)

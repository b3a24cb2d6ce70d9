"""The chaos run's erase checks (kbtools/chaos/checks/removals.py) on real PostgreSQL: after a real
erase, a real `pg_dump` of the database holds none of the erased version's marker and the
database holds nothing of it, so the checks report nothing; a marker then planted in a
table, a chunk planted back and an erase left unfinished are each reported."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from kbtools.chaos.checks.removals import Gone, check_dump, check_final, pg_dump, scan_dump
from kbtools.chaos.checks.result import DELETE_FINAL, ERASED_GONE, CheckResult
from kbtools.chaos.traffic.load import new_marker, render, text_of
from kbtools.devstack.postgres import pginstall_dir
from services.runtime.settings import RuntimeSettings
from tests.integration.test_document_delete import published, worker
from tests.support.api import ApiTenant, add_tenant
from tests.support.pipeline import running_pipeline
from tests.support.search import SearchHarness, search_harness

pytestmark = pytest.mark.integration


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[SearchHarness]:
    async with search_harness(settings) as harness:
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")


async def _indexed(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], marker: str
) -> str:
    content = render("md", "Record 1", text_of(random.Random(1), 1, 1, marker))
    document_id, _ = await published(api, acme, content)
    async with running_pipeline(pool) as indexer:
        assert (await worker(pool, indexer).run_once()).name == "SUCCEEDED"
    return document_id


def _dumped(database_url: str, tmp_path: Path, erased: str, kept: str) -> CheckResult:
    dump = tmp_path / "dump.sql"
    pg_dump(pginstall_dir() / "bin" / "pg_dump", database_url, dump)
    result = CheckResult()
    check_dump(scan_dump(dump), {erased: "the erased version"}, {kept}, result)
    return result


async def _plant_chunk(conn: asyncpg.Connection[Any], source: str, target: str) -> None:
    """A copy of one of ``source``'s chunks, as ``target``'s (a chunk an erase left)."""
    columns = [
        row["column_name"]
        for row in await conn.fetch(
            "SELECT column_name FROM information_schema.columns WHERE table_name ="
            " 'knowledge_chunk' AND is_generated = 'NEVER' ORDER BY ordinal_position"
        )
    ]
    chosen = ", ".join(
        "$2::uuid" if c == "document_id" else "chunk_id || '-planted'" if c == "chunk_id" else c
        for c in columns
    )
    names = ", ".join(columns)
    await conn.execute(
        f"INSERT INTO knowledge_chunk ({names}) SELECT {chosen} FROM knowledge_chunk"
        " WHERE document_id = $1::uuid LIMIT 1",
        source,
        target,
    )


async def test_the_erase_checks_pass_a_real_erase_and_report_what_is_planted(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
    database_url: str,
    tmp_path: Path,
) -> None:
    erased, kept = new_marker(random.Random(11)), new_marker(random.Random(12))
    doomed = await _indexed(api, acme, pool, erased)
    other = await _indexed(api, acme, pool, kept)
    before = _dumped(database_url, tmp_path, erased, kept)
    assert before.violations[ERASED_GONE] == 2  # as text (its chunk) and as bytes (its upload)

    response = await api.client.post(acme.path(f"/documents/{doomed}/erase"), headers=acme.headers)
    assert response.status_code == 200, response.text
    gone = {doomed: Gone("acme", doomed, 0.0, 0, erased=True)}
    result = _dumped(database_url, tmp_path, erased, kept)
    await check_final(conn, gone, set(), [], result)
    assert result.total == 0, result.evidence
    assert result.figures["kept markers found in the pg_dump (text / bytes)"] == "1 / 1 of 1"

    # A marker left in a table: a task's error text quoting the erased content.
    await conn.execute(
        "UPDATE index_task SET error_message = $2 WHERE document_id = $1",
        uuid.UUID(other),
        f"cannot read {erased}",
    )
    result = _dumped(database_url, tmp_path, erased, kept)
    assert result.violations[ERASED_GONE] == 1
    assert "as text (public.index_task)" in result.evidence[ERASED_GONE][0]

    # A chunk left behind, and the audit row saying the erase never finished.
    await _plant_chunk(conn, other, doomed)
    await conn.execute(
        "UPDATE document_erasure SET erased_at = NULL WHERE document_id = $1", uuid.UUID(doomed)
    )
    result = CheckResult()
    await check_final(conn, gone, set(), [], result)
    assert result.violations[ERASED_GONE] == 1, result.evidence
    assert "erase finished False (asked True), 1 chunks" in result.evidence[ERASED_GONE][0]

    # A document the run never deleted is not judged erased; one deleted without the run
    # asking is reported, unless the run's delete went unanswered (it may have committed).
    result = CheckResult()
    await check_final(conn, {}, set(), [], result)
    assert result.violations[DELETE_FINAL] == 1
    assert "yet the run never deleted it" in result.evidence[DELETE_FINAL][0]
    result = CheckResult()
    await check_final(conn, {}, {doomed}, [], result)
    assert result.total == 0, result.evidence

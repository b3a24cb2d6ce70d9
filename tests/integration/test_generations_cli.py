"""`kb index generations create|status|switch|retire` against real PostgreSQL.

Completions in a generation being built are simulated the way the sink records them: the
generation's chunks in knowledge_chunk and its document_generation_version row (the real
indexer path has tests of its own); everything else is the commands' own SQL.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest

from services.index.ann import ann_index_name, tenant_ann_index_name
from services.index.generations import SearchGeneration
from services.indexer.generations.model import (
    GENERATION_RETIRED,
    AnnIndexBuild,
    GenerationSpec,
    SwitchRefused,
)
from services.indexer.generations.retire import PgRetirement
from services.indexer.generations.store_pg import PgGenerations
from services.runtime.errors import BadInput, DatabaseBusy, NotFound
from tests.support.cli import kb
from tests.support.generations import (
    NEW,
    NEW_MODEL,
    NEW_SETTINGS,
    NEW_STRATEGY,
    OLD_MODEL,
    OLD_STRATEGY,
    add_chunks,
    add_document,
    build,
    new_generation,
    one_row,
    pointers,
    register_default,
    tenant_rows,
)
from tests.support.locks import wait_until_blocked_on_a_lock

pytestmark = pytest.mark.integration


async def test_create_pins_copies_pointers_and_enqueues_the_backfill_tasks(
    pool: asyncpg.Pool[Any],
) -> None:
    default = await register_default(pool)
    served = await add_document(pool, "acme")
    ahead = await add_document(pool, "acme", served=1, published=2)  # v2 not yet indexed
    unserved = await add_document(pool, "acme", served=None)  # published, not yet indexed
    beta = await add_document(pool, "beta")
    other = await add_document(pool, "gamma")
    store = PgGenerations(pool)

    outcome = await store.create(NEW, ["acme", "beta"], max_attempts=5)

    g = outcome.generation.generation_id
    assert outcome.created
    assert (outcome.generation.embedding_model, outcome.generation.is_default) == (NEW_MODEL, False)
    assert sorted(outcome.pinned) == ["acme", "beta"]
    assert await tenant_rows(pool) == {
        ("acme", default, True),
        ("acme", g, False),
        ("beta", default, True),
        ("beta", g, False),
    }
    copied = await pool.fetch(
        "SELECT document_id, version_number, chunking_strategy, chunk_count"
        " FROM document_generation_version WHERE generation_id = $1",
        default,
    )
    assert {r["document_id"]: (r["version_number"], r["chunk_count"]) for r in copied} == {
        served.document_id: (1, 2),
        ahead.document_id: (1, 2),
        beta.document_id: (1, 2),
    }
    tasks = await pool.fetch(
        "SELECT document_id, version_number, priority, status, tier, max_attempts"
        " FROM index_task WHERE generation_id = $1",
        g,
    )
    # The served version, and a newer published one as well: should v2 never index, the
    # generation still holds what search serves.
    assert sorted((r["document_id"], r["version_number"]) for r in tasks) == sorted(
        [
            (served.document_id, 1),
            (ahead.document_id, 1),
            (ahead.document_id, 2),
            (unserved.document_id, 1),
            (beta.document_id, 1),
        ]
    )
    assert {(r["priority"], r["status"], r["tier"], r["max_attempts"]) for r in tasks} == {
        (1, "PENDING", "standard", 5)
    }
    assert outcome.backfill_tasks == 5
    assert other.document_id not in {r["document_id"] for r in tasks}

    again = await store.create(NEW, ["acme", "beta"], max_attempts=5)

    assert (again.generation.generation_id, again.created) == (g, False)
    assert (again.pinned, again.added, again.backfill_tasks) == ([], [], 0)
    assert await pool.fetchval("SELECT count(*) FROM index_task WHERE generation_id = $1", g) == 5
    assert await pool.fetchval("SELECT count(*) FROM search_generation") == 2


async def test_create_refuses_what_cannot_be_built_and_changes_nothing(
    pool: asyncpg.Pool[Any],
) -> None:
    store = PgGenerations(pool)
    await add_document(pool, "acme")
    with pytest.raises(BadInput, match="no default generation"):
        await store.create(NEW, ["acme"], max_attempts=8)
    default = await register_default(pool)
    with pytest.raises(BadInput, match="one dimension"):
        await store.create(
            GenerationSpec("default", OLD_MODEL, 8, 200, 0), ["acme"], max_attempts=8
        )
    with pytest.raises(BadInput, match="the default"):
        await store.create(
            GenerationSpec("default", OLD_MODEL, 3, 256, 0), ["acme"], max_attempts=8
        )
    with pytest.raises(NotFound, match="no tenant 'nobody'"):
        await store.create(NEW, ["acme", "nobody"], max_attempts=8)
    assert await tenant_rows(pool) == set()
    assert await pool.fetchval("SELECT count(*) FROM search_generation") == 1
    assert await pool.fetchval("SELECT count(*) FROM index_task") == 0
    assert await pool.fetchval("SELECT count(*) FROM document_generation_version") == 0
    assert default


async def test_switch_is_refused_while_documents_are_missing_and_changes_nothing(
    pool: asyncpg.Pool[Any],
) -> None:
    default = await register_default(pool)
    built = await add_document(pool, "acme")
    missing = await add_document(pool, "acme")
    behind = await add_document(pool, "acme", served=2, published=2)
    g = await new_generation(pool, ["acme"])
    await build(pool, built, g)
    await build(pool, behind, g, version=1)  # older than the served v2
    before = (await pointers(pool, "acme"), await tenant_rows(pool))

    with pytest.raises(SwitchRefused) as refused:
        await PgGenerations(pool).switch("acme", g, force=False)

    assert refused.value.total == 2
    assert {(m.document_id, m.served_version, m.built_version) for m in refused.value.missing} == {
        (missing.document_id, 1, None),
        (behind.document_id, 2, 1),
    }
    assert (await pointers(pool, "acme"), await tenant_rows(pool)) == before
    assert ("acme", default, True) in before[1]


async def test_switch_rewrites_every_pointer_and_switching_back_rolls_back(
    pool: asyncpg.Pool[Any],
) -> None:
    default = await register_default(pool)
    docs = [await add_document(pool, "acme") for _ in range(3)]
    bystander = await add_document(pool, "beta")
    g = await new_generation(pool, ["acme", "beta"])
    for doc in docs:
        await build(pool, doc, g)
    served_before = await pointers(pool, "acme")
    since = "SELECT document_id, switched_at FROM document_search_version WHERE tenant_id = $1"
    searchable_since = {r["document_id"]: r["switched_at"] for r in await pool.fetch(since, "acme")}
    store = PgGenerations(pool)

    outcome = await store.switch("acme", g, force=False)

    assert (outcome.previous, outcome.target, outcome.rewritten) == (default, g, 3)
    assert set((await pointers(pool, "acme")).values()) == {(1, NEW_MODEL, NEW_STRATEGY, 3)}
    assert ("acme", g, True) in await tenant_rows(pool)
    assert ("acme", default, False) in await tenant_rows(pool)
    # The same versions, searchable since they were: no publish -> searchable sample moves.
    assert {r["document_id"]: r["switched_at"] for r in await pool.fetch(since, "acme")} == (
        searchable_since
    )
    # Another tenant's search did not move.
    assert set((await pointers(pool, "beta")).values()) == {(1, OLD_MODEL, OLD_STRATEGY, 2)}
    assert bystander
    # The old generation's chunks stay, for the rollback.
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM knowledge_chunk"
            " WHERE tenant_id = 'acme' AND embedding_model = $1",
            OLD_MODEL,
        )
        == 6
    )

    back = await store.switch("acme", default, force=False)

    assert (back.previous, back.target, back.rewritten) == (g, default, 3)
    assert await pointers(pool, "acme") == served_before
    assert ("acme", default, True) in await tenant_rows(pool)
    again = await store.switch("acme", default, force=False)
    assert not again.switched


async def test_force_switches_and_drops_the_pointers_of_missing_documents(
    pool: asyncpg.Pool[Any],
) -> None:
    await register_default(pool)
    built = await add_document(pool, "acme")
    missing = await add_document(pool, "acme")
    g = await new_generation(pool, ["acme"])
    await build(pool, built, g)

    outcome = await PgGenerations(pool).switch("acme", g, force=True)

    assert outcome.dropped_total == 1
    assert [m.document_id for m in outcome.dropped] == [missing.document_id]
    assert await pointers(pool, "acme") == {built.document_id: (1, NEW_MODEL, NEW_STRATEGY, 3)}
    assert ("acme", g, True) in await tenant_rows(pool)


async def test_switch_refuses_a_generation_the_tenant_is_not_built_in(
    pool: asyncpg.Pool[Any],
) -> None:
    await register_default(pool)
    await add_document(pool, "acme")
    await add_document(pool, "beta")
    g = await new_generation(pool, ["beta"])
    with pytest.raises(BadInput, match="not built in generation"):
        await PgGenerations(pool).switch("acme", g, force=True)
    assert ("acme", g, False) not in await tenant_rows(pool)


async def test_retire_refuses_the_default_and_a_serving_generation(
    pool: asyncpg.Pool[Any],
) -> None:
    default = await register_default(pool)
    doc = await add_document(pool, "acme")
    g = await new_generation(pool, ["acme"])
    await build(pool, doc, g)
    store = PgGenerations(pool)
    await store.switch("acme", g, force=False)

    with pytest.raises(BadInput, match="the default"):
        await store.retire(default)
    with pytest.raises(BadInput, match="serves 1 tenants \\(acme\\)"):
        await store.retire(g)

    states = await pool.fetch("SELECT state FROM search_generation")
    assert {r["state"] for r in states} == {"ACTIVE"}
    assert ("acme", g, True) in await tenant_rows(pool)
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM knowledge_chunk WHERE embedding_model = $1", NEW_MODEL
        )
        == 3
    )


async def test_retire_deletes_the_generation_in_batches_and_can_run_again(
    pool: asyncpg.Pool[Any],
) -> None:
    await register_default(pool)
    docs = [await add_document(pool, tenant) for tenant in ("acme", "acme", "beta")]
    g = await new_generation(pool, ["acme", "beta"])
    for doc in docs[:2]:
        await build(pool, doc, g)
    # An older version's chunks too: everything of the generation goes.
    await add_document(pool, "acme", served=1, published=2)
    await pool.execute(
        "UPDATE index_task SET status = 'SUCCEEDED', finished_at = now()"
        " WHERE generation_id = $1 AND document_id = $2",
        g,
        docs[0].document_id,
    )
    store = PgGenerations(pool, batch_size=2, partition_graphs=True)
    generation = SearchGeneration.from_record(
        await one_row(pool, "SELECT * FROM search_generation WHERE generation_id = $1", g)
    )
    assert await PgGenerations(pool).ensure_ann_index(generation) is AnnIndexBuild.OFF
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM pg_class WHERE relname = $1", ann_index_name(NEW_MODEL)
        )
        == 0
    )
    assert await store.ensure_ann_index(generation) is AnnIndexBuild.BUILT
    assert await store.ensure_ann_index(generation) is AnnIndexBuild.PRESENT
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM pg_class WHERE relname = $1", ann_index_name(NEW_MODEL)
        )
        == 1
    )
    # acme serves 6 chunks, beta 2: acme gets a graph of the new model of its own.
    assert await store.tenant_graphs(generation, None, min_chunks=4) == ["acme"]
    old_chunks = await pool.fetchval(
        "SELECT count(*) FROM knowledge_chunk WHERE embedding_model = $1", OLD_MODEL
    )
    before = {doc.tenant_id: await pointers(pool, doc.tenant_id) for doc in docs}

    outcome = await store.retire(g)

    assert outcome.chunks_deleted == 6
    assert outcome.document_rows_deleted == 2
    assert outcome.tasks_deleted == 3
    assert outcome.tasks_ended == 2
    assert outcome.indexes_dropped == [
        tenant_ann_index_name(NEW_MODEL, "acme"),
        ann_index_name(NEW_MODEL),
    ]
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM knowledge_chunk WHERE embedding_model = $1", NEW_MODEL
        )
        == 0
    )
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM knowledge_chunk WHERE embedding_model = $1", OLD_MODEL
        )
        == old_chunks
    )
    assert {doc.tenant_id: await pointers(pool, doc.tenant_id) for doc in docs} == before
    for table in ("document_generation_version", "index_task", "tenant_search_generation"):
        assert (
            await pool.fetchval(f"SELECT count(*) FROM {table} WHERE generation_id = $1", g) == 0
        ), table
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM pg_class WHERE relname LIKE $1", ann_index_name(NEW_MODEL) + "%"
        )
        == 0
    )
    row = await one_row(
        pool, "SELECT state, retired_at FROM search_generation WHERE generation_id = $1", g
    )
    assert row["state"] == "RETIRED"
    assert row["retired_at"] is not None

    again = await store.retire(g)
    assert again.already_retired
    # A retired setup may be created again: a generation of its own.
    recreated = await store.create(NEW, ["acme"], max_attempts=8)
    assert recreated.created
    assert recreated.generation.generation_id != g


async def test_retire_ends_unfinished_tasks_before_deleting_them(
    pool: asyncpg.Pool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first transaction alone (the rest crashes, say): no worker claims the
    generation's tasks any more, and a running one's completion is fenced out."""
    await register_default(pool)
    await add_document(pool, "acme")
    g = await new_generation(pool, ["acme"])
    await pool.execute(
        "UPDATE index_task SET status = 'RUNNING', lease_owner = 'w', lease_until = now()"
        " + interval '1 minute' WHERE generation_id = $1",
        g,
    )
    store = PgGenerations(pool)

    async def crash(self: PgRetirement, generation: SearchGeneration) -> int:
        raise RuntimeError("crashed after the first transaction")

    with monkeypatch.context() as patched:
        patched.setattr(PgRetirement, "_delete_chunks", crash)
        with pytest.raises(RuntimeError):
            await store.retire(g)
    task = await one_row(pool, "SELECT status, error_code, lease_owner FROM index_task")
    assert tuple(task.values()) == ("DEAD", GENERATION_RETIRED, None)
    assert await pool.fetchval(
        "SELECT state FROM search_generation WHERE generation_id = $1", g
    ) == ("RETIRING")

    outcome = await PgGenerations(pool).retire(g)  # run again: it finishes

    assert outcome.tasks_deleted == 1
    assert await pool.fetchval(
        "SELECT state FROM search_generation WHERE generation_id = $1", g
    ) == ("RETIRED")


async def test_status_counts_done_pending_failed_chunks_and_serving_tenants(
    pool: asyncpg.Pool[Any],
) -> None:
    default = await register_default(pool)
    done, pending, failed = [await add_document(pool, "acme") for _ in range(3)]
    await add_document(pool, "beta")
    g = await new_generation(pool, ["acme"])
    await build(pool, done, g, chunks=4)
    await pool.execute(
        "UPDATE index_task SET status = 'SUCCEEDED', finished_at = now()"
        " WHERE generation_id = $1 AND document_id = $2",
        g,
        done.document_id,
    )
    await pool.execute(
        "UPDATE index_task SET status = 'DEAD', finished_at = now(), error_code = 'X'"
        " WHERE generation_id = $1 AND document_id = $2",
        g,
        failed.document_id,
    )
    assert pending

    found = {
        s.summary.generation.generation_id: s
        for s in await PgGenerations(pool).status(None, on_disk=True)
    }

    new = found[g]
    assert (new.progress.done, new.progress.pending, new.progress.failed) == (1, 1, 1)
    assert new.progress.chunks == 4
    assert round(new.progress.percent) == 33
    assert (new.chunks_on_disk, new.summary.tenants_serving, new.serving) == (4, 0, [])
    assert new.summary.tenants_built == 1
    assert new.bytes_on_disk

    old = found[default]
    # acme is pinned (its rows were copied), beta is served by the default without a row.
    assert (old.summary.tenants_serving, old.serving) == (2, ["acme", "beta"])
    assert (old.progress.done, old.progress.pending, old.progress.failed) == (3, 0, 0)
    assert old.chunks_on_disk == 8

    only_beta = await PgGenerations(pool).status("beta", on_disk=True)
    by_id = {s.summary.generation.generation_id: s for s in only_beta}
    assert (by_id[g].progress.done, by_id[g].progress.pending, by_id[g].chunks_on_disk) == (0, 0, 0)
    assert by_id[default].serving == ["beta"]


async def test_cli_refuses_bad_input_with_exit_2_and_changes_nothing(
    pool: asyncpg.Pool[Any], service_env: dict[str, str]
) -> None:
    default = await register_default(pool)
    built = await add_document(pool, "acme")
    missing = await add_document(pool, "acme")
    g = await new_generation(pool, ["acme"])
    await build(pool, built, g)
    state = (await pointers(pool, "acme"), await tenant_rows(pool))
    counts = "SELECT (SELECT count(*) FROM search_generation), (SELECT count(*) FROM index_task)"
    before = tuple(await one_row(pool, counts))
    create = ("index", "generations", "create", "--provider", "default", "--model", NEW_MODEL)

    cases = {
        "no tenants": ((*create, "--dimensions", "4"), "--tenant T (repeatable) or --all"),
        "both": ((*create, "--dimensions", "4", "--tenant", "acme", "--all"), "or --all"),
        "dimension": ((*create, "--dimensions", "0", "--all"), "--dimensions 0"),
        "profile": (
            (
                "index",
                "generations",
                "create",
                "--provider",
                "hosted",
                "--model",
                "m",
                "--dimensions",
                "4",
                "--all",
            ),
            "no embedding profile 'hosted'",
        ),
        "model of the profile": ((*create, "--dimensions", "5", "--all"), "only serves"),
        "tenant": (("index", "generations", "switch", "--tenant", "Bad!", "--to", "1"), "tenant"),
        "generation": (
            ("index", "generations", "switch", "--tenant", "acme", "--to", "999"),
            "no generation 999",
        ),
        "retire default": (("index", "generations", "retire", str(default)), "the default"),
    }
    env = {**service_env, "KB_EMBEDDING_PROVIDER": "hashing"}
    for name, (args, message) in cases.items():
        result = kb(env, *args)
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert message in result.stderr, (name, result.stderr)

    refused = kb(env, "index", "generations", "switch", "--tenant", "acme", "--to", str(g))

    assert refused.returncode == 2, refused.stderr
    assert refused.stdout.split()[0] == str(missing.document_id)
    assert "GENERATION_INCOMPLETE" in refused.stderr
    assert (await pointers(pool, "acme"), await tenant_rows(pool)) == state
    assert tuple(await one_row(pool, counts)) == before


@pytest.mark.parametrize("partition_graphs", [False, True])
async def test_cli_creates_lists_and_switches(
    pool: asyncpg.Pool[Any], service_env: dict[str, str], partition_graphs: bool
) -> None:
    await register_default(pool)
    doc = await add_document(pool, "acme")
    env = {
        **service_env,
        "KB_EMBEDDING_PROVIDER": "hashing",
        "KB_INDEXER_PARTITION_GRAPHS": str(partition_graphs).lower(),
    }

    created = kb(
        env,
        "index",
        "generations",
        "create",
        "--provider",
        "default",
        "--model",
        NEW_MODEL,
        "--dimensions",
        "4",
        "--chunk-tokens",
        "200",
        "--tenant",
        "acme",
    )

    assert created.returncode == 0, created.stderr
    g = int(created.stdout.strip())
    assert "1 backfill tasks enqueued" in created.stderr
    valid = await pool.fetchval(
        "SELECT indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE c.relname = $1",
        ann_index_name(NEW_MODEL),
    )
    if partition_graphs:
        assert valid is True
        assert f"partition graphs of {NEW_MODEL}: built" in created.stderr
    else:
        assert valid is None  # no such index
        assert (
            f"partition graphs of {NEW_MODEL}: off (KB_INDEXER_PARTITION_GRAPHS)" in created.stderr
        )
    listed = kb(env, "index", "generations", "list")
    assert listed.returncode == 0, listed.stderr
    assert f"{g}  default  {NEW_MODEL}  4  200/0  ACTIVE  -  serving=0  built=1" in listed.stdout
    await pool.execute(
        "UPDATE search_generation SET chunking_settings = $2 WHERE generation_id = $1",
        g,
        NEW_SETTINGS,
    )
    await build(pool, doc, g)

    status = kb(env, "index", "generations", "status", "--tenant", "acme", "--json")
    assert status.returncode == 0, status.stderr
    [shown] = [row for row in json.loads(status.stdout) if row["generationId"] == g]
    assert (shown["embeddingModel"], shown["done"], shown["pending"], shown["chunks"]) == (
        NEW_MODEL,
        1,
        1,
        3,
    )
    assert (shown["tenantsBuilt"], shown["tenantsServing"], shown["isDefault"]) == (1, 0, False)
    switched = kb(env, "index", "generations", "switch", "--tenant", "acme", "--to", str(g))
    assert switched.returncode == 0, switched.stderr
    assert "1 pointers rewritten" in switched.stderr
    assert set((await pointers(pool, "acme")).values()) == {(1, NEW_MODEL, NEW_STRATEGY, 3)}


async def test_a_retire_waits_for_a_switch_to_it_in_flight_and_then_refuses(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    default = await register_default(pool)
    doc = await add_document(pool, "acme")
    g = await new_generation(pool, ["acme"])
    await build(pool, doc, g)
    switching = await asyncpg.connect(database_url)
    try:
        # A switch to g between its lock of the tenant's rows and its commit.
        transaction = switching.transaction()
        await transaction.start()
        await switching.fetch(
            "SELECT * FROM tenant_search_generation WHERE tenant_id = 'acme' FOR UPDATE"
        )
        await switching.execute(
            "UPDATE tenant_search_generation SET serving = false WHERE tenant_id = 'acme'"
        )
        await switching.execute(
            "UPDATE tenant_search_generation SET serving = true"
            " WHERE tenant_id = 'acme' AND generation_id = $1",
            g,
        )
        retiring = asyncio.create_task(PgGenerations(pool).retire(g))
        await wait_until_blocked_on_a_lock(pool)
        assert not retiring.done()
        await transaction.commit()
        with pytest.raises(BadInput, match="serves 1 tenants"):
            await retiring
    finally:
        await switching.close()
    state = "SELECT state FROM search_generation WHERE generation_id = $1"
    assert await pool.fetchval(state, g) == "ACTIVE"
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM index_task WHERE generation_id = $1 AND status = 'PENDING'", g
        )
        == 1
    )
    assert ("acme", default, False) in await tenant_rows(pool)


async def test_a_switch_serves_the_newer_version_a_generation_holds_and_never_goes_back(
    pool: asyncpg.Pool[Any],
) -> None:
    """A version published during the backfill, indexed into both generations (dual write)
    but not yet served: the switch serves it, and the switch back keeps it."""
    default = await register_default(pool)
    doc = await add_document(pool, "acme", served=1, published=2)
    await pool.execute("UPDATE document_search_version SET switched_at = now() - interval '1 day'")
    g = await new_generation(pool, ["acme"])
    await build(pool, doc, g, version=2)
    # The default's own completion of v2 is still on its way when the switch runs.
    outcome = await PgGenerations(pool).switch("acme", g, force=False)

    assert outcome.rewritten == 1
    assert await pointers(pool, "acme") == {doc.document_id: (2, NEW_MODEL, NEW_STRATEGY, 3)}
    since = await pool.fetchval(
        "SELECT switched_at > now() - interval '1 minute' FROM document_search_version"
    )
    assert since

    with pytest.raises(SwitchRefused) as refused:  # the default holds only v1
        await PgGenerations(pool).switch("acme", default, force=False)
    assert [(m.served_version, m.built_version) for m in refused.value.missing] == [(2, 1)]

    await build(pool, doc, default, version=2, model=OLD_MODEL, strategy=OLD_STRATEGY, dimension=3)
    back = await PgGenerations(pool).switch("acme", default, force=False)

    assert back.rewritten == 1
    assert await pointers(pool, "acme") == {doc.document_id: (2, OLD_MODEL, OLD_STRATEGY, 3)}


async def test_kb_index_gc_collects_every_marked_document(
    pool: asyncpg.Pool[Any], service_env: dict[str, str]
) -> None:
    docs = [await add_document(pool, "acme", served=2, published=2) for _ in range(3)]
    for doc in docs:  # the chunks of v1, superseded by the served v2
        await add_chunks(pool, doc, 1, OLD_MODEL, OLD_STRATEGY, 3, 2)
        await pool.execute(
            "INSERT INTO index_gc_due (tenant_id, document_id) VALUES ($1, $2)",
            doc.tenant_id,
            doc.document_id,
        )
    env = {**service_env, "KB_INDEX_KEEP_PREVIOUS": "0", "KB_INDEX_GC_BATCH_ROWS": "1"}

    collected = kb(env, "index", "gc", "--round", "2")

    assert collected.returncode == 0, collected.stderr
    assert "6 chunks collected, 3 documents clean" in collected.stderr
    versions = await pool.fetch("SELECT DISTINCT version_number FROM knowledge_chunk")
    assert [r["version_number"] for r in versions] == [2]
    assert await pool.fetchval("SELECT count(*) FROM index_gc_due") == 0


async def test_a_retire_that_cannot_drop_the_index_for_a_long_transaction_stays_retiring(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    """The DROP INDEX gives up rather than hold every search up behind it; running the
    command again finishes."""
    await register_default(pool)
    doc = await add_document(pool, "acme")
    g = await new_generation(pool, ["acme"])
    await build(pool, doc, g)
    generation = SearchGeneration.from_record(
        await one_row(pool, "SELECT * FROM search_generation WHERE generation_id = $1", g)
    )
    built = await PgGenerations(pool, partition_graphs=True).ensure_ann_index(generation)
    assert built is AnnIndexBuild.BUILT
    reader = await asyncpg.connect(database_url)
    try:
        reading = reader.transaction()
        await reading.start()
        await reader.fetch("SELECT chunk_id FROM knowledge_chunk LIMIT 1")  # its lock, held
        impatient = PgRetirement(pool, lock_timeout="100ms", drop_attempts=2, drop_pause_seconds=0)
        with pytest.raises(DatabaseBusy, match="retire` again"):
            await impatient.retire(g)
        state = "SELECT state FROM search_generation WHERE generation_id = $1"
        assert await pool.fetchval(state, g) == "RETIRING"
        assert (
            await pool.fetchval(
                "SELECT count(*) FROM knowledge_chunk WHERE embedding_model = $1", NEW_MODEL
            )
            == 0
        )
        await reading.rollback()
    finally:
        await reader.close()

    again = await PgGenerations(pool).retire(g)

    assert again.indexes_dropped == [ann_index_name(NEW_MODEL)]
    assert await pool.fetchval(state, g) == "RETIRED"


async def test_a_switch_serves_a_document_only_the_target_holds(pool: asyncpg.Pool[Any]) -> None:
    """A new document built in the target (dual write) whose serving generation's task has
    not completed: once switched, that task completes beside the target and moves no
    pointer, so the switch itself makes the document searchable."""
    await register_default(pool)
    served = await add_document(pool, "acme", served=1)
    fresh = await add_document(pool, "acme", served=None)
    g = await new_generation(pool, ["acme"])
    await build(pool, served, g, version=1)
    await build(pool, fresh, g, version=1)

    outcome = await PgGenerations(pool).switch("acme", g, force=False)

    assert outcome.switched
    assert await pointers(pool, "acme") == {
        served.document_id: (1, NEW_MODEL, NEW_STRATEGY, 3),
        fresh.document_id: (1, NEW_MODEL, NEW_STRATEGY, 3),
    }

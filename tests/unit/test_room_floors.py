"""Floors inside the parts of ``services`` (docs/architecture.md#layers), and inside the
chaos run of the tools (``kbtools.chaos``): the rooms of a package, bottom up.

A room is a module or a sub-package directly inside a package named in ``ROOMS``. A module
in a room may import its own room and the rooms on floors below; never a room above, never
a sibling on its own floor. A package's floors name every room it has, so a new room must
say where it stands. Imports are read as in ``test_import_rules.py``: lazy ones and
``TYPE_CHECKING`` blocks included.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.stack import REPO_ROOT
from tests.unit.test_import_rules import Violation, modules

# Package -> its rooms, bottom up.
ROOMS: dict[str, tuple[frozenset[str], ...]] = {
    # The publisher: its ports and leaf helpers, the domain on them, the adapters and
    # counters, the rooms of their own, then the HTTP side and the commands on top.
    "services.publisher": (
        frozenset({"ports", "failures", "text", "settings", "strict_form"}),
        frozenset({"domain"}),
        frozenset({"store_pg", "metrics"}),
        frozenset({"bulk", "keys"}),
        frozenset({"ingest"}),
        frozenset({"web"}),
        frozenset({"cli", "documents_cli"}),
    ),
    # Publish by event: the commands, their signatures and key cache, settings, ports, counters;
    # the apply step; its store, the refusals' retention and the records' processing; Kafka;
    # the loop; `kb ingest`.
    "services.publisher.ingest": (
        frozenset({"commands", "signing", "settings", "metrics"}),
        frozenset({"ports", "key_cache"}),
        frozenset({"apply"}),
        frozenset({"runs", "store_pg", "retention"}),
        frozenset({"process"}),
        frozenset({"consumer_kafka"}),
        frozenset({"pipeline"}),
        frozenset({"cli"}),
    ),
    "services.publisher.bulk": (frozenset({"domain", "form"}), frozenset({"store_pg"})),
    "services.publisher.keys": (
        frozenset({"store_pg"}),
        frozenset({"cli"}),
        frozenset({"verification_cli"}),
    ),
    "services.publisher.web": (
        frozenset({"middleware", "links", "wire", "readiness"}),
        frozenset(
            {
                "body_limit",
                "request_metrics",
                "routes",
                "bulk_routes",
                "ops_routes",
                "ingest_key_routes",
            }
        ),
        frozenset({"upload_budget"}),
        frozenset({"api"}),
        frozenset({"openapi", "server"}),
    ),
    # Search: what is kept a short while, counters and small helpers, the driver-free
    # searcher, SQL assembly, the connections and paths, the transaction and the replicas,
    # then what serves a request.
    "services.search": (
        frozenset({"kept"}),
        frozenset({"metrics", "keyword_terms", "primary_position", "read_pool"}),
        frozenset({"searcher"}),
        frozenset({"statements"}),
        frozenset({"paths", "connections"}),
        frozenset({"index_pg", "replicas"}),
        frozenset({"serving", "routes"}),
    ),
    # The relay: ports, settings, counters and send spans, the parts the loop drives, the loop,
    # `kb relay`.
    "services.relay": (
        frozenset({"ports", "settings", "metrics"}),
        frozenset({"send_spans"}),
        frozenset({"driver", "gauges", "outbox_pg", "sink_kafka", "replay"}),
        frozenset({"relay"}),
        frozenset({"cli"}),
    ),
    "services.operator": (
        frozenset({"settings", "charts", "store_pg"}),
        frozenset({"auth", "context"}),
        frozenset({"routes", "cli"}),
    ),
    # The indexer: the task and its lease, chunks and settings on the ground floor; the
    # ports, the retry policy and the pool on them; the collector; the queue and the sink,
    # which never import each other; the counters; the pipeline; the generations room,
    # which builds pipelines and drives the sink; the assembly, `kb indexer`, `kb index`.
    "services.indexer": (
        frozenset({"settings", "task", "chunk"}),
        frozenset({"ports", "retry", "pool"}),
        frozenset({"gc"}),
        frozenset({"queue", "sink"}),
        frozenset({"metrics"}),
        frozenset({"pipeline"}),
        frozenset({"generations"}),
        frozenset({"wiring"}),
        frozenset({"cli"}),
        frozenset({"maintenance"}),
    ),
    "services.indexer.gc": (frozenset({"settings"}), frozenset({"collector", "retention"})),
    "services.indexer.queue": (
        frozenset({"attempt_span", "failed"}),
        frozenset({"attempt", "completions", "hints"}),
        frozenset({"store_pg", "worker", "hints_kafka"}),
    ),
    "services.indexer.sink": (
        frozenset({"default_change", "known", "version"}),
        frozenset({"generations", "stream"}),
        frozenset({"write"}),
        frozenset({"together"}),
        frozenset({"pgvector"}),
        frozenset({"tenant_graphs"}),
    ),
    "services.indexer.pipeline": (
        frozenset({"section", "chunking_code"}),
        frozenset({"chunking"}),
        frozenset({"parsing", "slices", "timed_write", "source_pg"}),
        frozenset({"generations"}),
        frozenset({"version_indexer"}),
    ),
    "services.indexer.pipeline.parsing": (
        frozenset({"limits"}),
        frozenset({"text"}),
        frozenset({"markdown", "html", "pdf", "docx"}),
        frozenset({"stream"}),
        frozenset({"pool"}),
    ),
    "services.indexer.generations": (
        frozenset({"model", "build"}),
        frozenset({"queries"}),
        frozenset({"switch", "retire"}),
        frozenset({"store_pg"}),
        frozenset({"cli"}),
    ),
    "services.indexer.maintenance": (
        frozenset({"index_check"}),
        frozenset({"index_check_pg", "partition_graphs"}),
        frozenset({"cli"}),
    ),
    # The chaos run: the system it runs and breaks, what it sends to it, the checks of its
    # invariants (which read what both did), the run, `kb chaos`.
    "kbtools.chaos": (
        frozenset({"rig"}),
        frozenset({"traffic"}),
        frozenset({"checks"}),
        frozenset({"runner"}),
        frozenset({"cli"}),
    ),
    # The processes and their settings (the producer key the consumers trust among them),
    # then the fault driver that breaks them.
    "kbtools.chaos.rig": (
        frozenset({"ports", "schedule"}),
        frozenset({"topology"}),
        frozenset({"faults"}),
    ),
    # Poisons ride in front of commands, commands are a share of the load, and the
    # searches follow what the load published and removed.
    "kbtools.chaos.traffic": (
        frozenset({"poison"}),
        frozenset({"ingest"}),
        frozenset({"load"}),
        frozenset({"searcher"}),
    ),
    # The invariants' names, the logs' figures and the checks' SQL; one check per concept,
    # and the table; the checker that runs them all.
    "kbtools.chaos.checks": (
        frozenset({"result", "logs", "queries"}),
        frozenset(
            {"answers", "commands", "converge", "dead_letters", "removals", "rerun", "report"}
        ),
        frozenset({"checker"}),
    ),
}


def _rooms_of(root: Path, package: str) -> set[str]:
    folder = root.joinpath(*package.split("."))
    return {
        path.stem if path.is_file() else path.name
        for path in folder.iterdir()
        if (path.suffix == ".py" and path.name != "__init__.py")
        or (path.is_dir() and (path / "__init__.py").exists())
    }


def _room(module: str, package: str) -> str | None:
    """The room of ``package`` that ``module`` is in; None outside it or for the package
    itself."""
    prefix = package + "."
    if not module.startswith(prefix):
        return None
    return module.removeprefix(prefix).split(".")[0]


def room_violations(root: Path, rooms: dict[str, tuple[frozenset[str], ...]]) -> list[Violation]:
    found: list[Violation] = []
    for package, floors in rooms.items():
        level = {room: floor for floor, names in enumerate(floors) for room in names}
        existing = _rooms_of(root, package)
        for missing in sorted(existing - level.keys()):
            found.append(Violation(package, 0, missing, f"{package}.{missing} has no floor"))
        for module in modules(root, package.split(".")[0]):
            importer = _room(module.name, package)
            if importer is None or importer not in level:
                continue
            where = str(module.path.relative_to(root))
            for line, imported in module.imports:
                target = _room(imported, package)
                # `from package import name` also names package.name, a module only when
                # such a room exists.
                if target is None or target == importer or target not in existing:
                    continue
                if target not in level:
                    continue  # reported once above, as a room without a floor
                if level[target] > level[importer]:
                    why = f"upward inside {package}"
                elif level[target] == level[importer]:
                    why = f"sideways inside {package}"
                else:
                    continue
                found.append(Violation(where, line, imported, why))
    return found


def test_every_room_import_goes_down_its_floors() -> None:
    assert [str(v) for v in room_violations(REPO_ROOT, ROOMS)] == []


def test_every_declared_floor_names_a_room_that_exists() -> None:
    stale = [
        f"{package}.{room}"
        for package, floors in ROOMS.items()
        for names in floors
        for room in sorted(names)
        if room not in _rooms_of(REPO_ROOT, package)
    ]
    assert stale == []


# -- the checker itself, on planted trees -------------------------------------------------

PLANTED: dict[str, tuple[frozenset[str], ...]] = {
    "services.svc": (
        frozenset({"ports", "task"}),
        frozenset({"queue", "sink"}),
        frozenset({"wiring"}),
    ),
    "services.svc.queue": (frozenset({"store"}), frozenset({"worker"})),
}


def _plant(root: Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")


def _plant_clean(root: Path) -> None:
    for package in ("services", "services/svc", "services/svc/queue", "services/svc/sink"):
        _plant(root, f"{package}/__init__.py", "")
    _plant(root, "services/svc/ports.py", "from services.runtime import errors\n")
    _plant(root, "services/svc/task.py", "import dataclasses\n")
    _plant(root, "services/svc/queue/store.py", "from services.svc.task import Lease\n")
    _plant(
        root, "services/svc/queue/worker.py", "from .store import Store\nfrom ..ports import P\n"
    )
    _plant(root, "services/svc/sink/__init__.py", "from services.svc import ports\n")
    _plant(root, "services/svc/wiring.py", "from services.svc.queue.worker import W\n")


@pytest.mark.parametrize(
    ("relative", "source", "why"),
    [
        ("services/svc/ports.py", "from services.svc.queue.store import S\n", "upward"),
        ("services/svc/task.py", "from services.svc import wiring\n", "upward"),
        ("services/svc/ports.py", "from services.svc.task import Lease\n", "sideways"),
        ("services/svc/sink/x.py", "from ..queue import store\n", "sideways"),
        (
            "services/svc/queue/worker.py",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from services.svc import sink\n",
            "sideways",
        ),
        ("services/svc/queue/store.py", "def f():\n    from .worker import W\n", "upward"),
    ],
)
def test_the_checker_finds_a_planted_back_edge(
    tmp_path: Path, relative: str, source: str, why: str
) -> None:
    _plant_clean(tmp_path)
    assert room_violations(tmp_path, PLANTED) == []
    _plant(tmp_path, relative, source)
    found = room_violations(tmp_path, PLANTED)
    assert found, f"{relative} was not caught"
    assert all(why in v.why for v in found)
    assert {v.module for v in found} == {relative}


def test_the_checker_finds_a_room_without_a_floor(tmp_path: Path) -> None:
    _plant_clean(tmp_path)
    _plant(tmp_path, "services/svc/newroom.py", "")
    assert [v.why for v in room_violations(tmp_path, PLANTED)] == [
        "services.svc.newroom has no floor"
    ]


# -- the back-edges issue 42 took out, put back into a copy of the real tree ----------------


def _copy_services(root: Path) -> None:
    for source in (REPO_ROOT / "services").rglob("*.py"):
        target = root / source.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def _rooms_under(package: str) -> dict[str, tuple[frozenset[str], ...]]:
    return {name: floors for name, floors in ROOMS.items() if name.startswith(package)}


@pytest.mark.parametrize(
    ("relative", "source"),
    [
        # The counters took the HTTP middleware's base from the web room above them.
        (
            "services/publisher/metrics.py",
            "from services.publisher.web.middleware import HttpMiddleware\n",
        ),
        # The bulk room's routes took the wire models from the web room that mounts them.
        (
            "services/publisher/bulk/routes.py",
            "from services.publisher.web.wire import ApiModel, ReadAcl\n",
        ),
    ],
)
def test_a_publisher_back_edge_put_back_is_caught(
    tmp_path: Path, relative: str, source: str
) -> None:
    _copy_services(tmp_path)
    rooms = _rooms_under("services.publisher")
    assert room_violations(tmp_path, rooms) == []
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as file:
        file.write(source)
    found = room_violations(tmp_path, rooms)
    assert any(
        v.module == relative and v.why == "upward inside services.publisher" for v in found
    ), [str(v) for v in found]


def _copy_indexer(root: Path) -> None:
    """The indexer alone: its floors judge only imports between its own rooms."""
    indexer = sorted((REPO_ROOT / "services" / "indexer").rglob("*.py"))
    for source in [REPO_ROOT / "services" / "__init__.py", *indexer]:
        target = root / source.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


# The indexer's back-edges issue 42 took out. Each is planted as it stood (the module it
# named may be gone: the room it reached into is what the floors judge).
@pytest.mark.parametrize(
    ("relative", "source", "why"),
    [
        # ports.py took Lease from queue/task while the queue imported the ports.
        (
            "services/indexer/ports.py",
            "from services.indexer.queue.task import Lease\n",
            "upward inside services.indexer",
        ),
        # Six sink modules took Lease from the queue beside them.
        (
            "services/indexer/sink/version.py",
            "from services.indexer.queue.task import Lease\n",
            "sideways inside services.indexer",
        ),
        # The sink took Chunk from the pipeline, for the type checker only, while the
        # pipeline's generation build imported the sink.
        (
            "services/indexer/sink/write.py",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from services.indexer.pipeline.chunking import Chunk\n",
            "upward inside services.indexer",
        ),
        # The wiring took tenant graphs from the maintenance commands above it.
        (
            "services/indexer/wiring.py",
            "from services.indexer.maintenance.tenant_graphs import PgTenantGraphs\n",
            "upward inside services.indexer",
        ),
        # Chunking took Section from parsing/ while the parse pool and stream import chunking.
        (
            "services/indexer/pipeline/chunking.py",
            "from services.indexer.pipeline.parsing.section import Section\n",
            "upward inside services.indexer.pipeline",
        ),
        # The generations command took the pool and settings helpers from the CLI above it.
        (
            "services/indexer/generations/cli.py",
            "def _run():\n    from services.indexer.cli import with_pool\n",
            "upward inside services.indexer",
        ),
    ],
)
def test_an_indexer_back_edge_put_back_is_caught(
    tmp_path: Path, relative: str, source: str, why: str
) -> None:
    _copy_indexer(tmp_path)
    rooms = _rooms_under("services.indexer")
    assert room_violations(tmp_path, rooms) == []
    with (tmp_path / relative).open("a", encoding="utf-8") as file:
        file.write(source)
    found = room_violations(tmp_path, rooms)
    assert any(v.module == relative and v.why == why for v in found), [str(v) for v in found]


# -- the chaos run's back-edges its split into rooms took out, put back into a copy ---------


def _copy_chaos(root: Path) -> None:
    chaos = sorted((REPO_ROOT / "kbtools" / "chaos").rglob("*.py"))
    for source in [REPO_ROOT / "kbtools" / "__init__.py", *chaos]:
        target = root / source.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


@pytest.mark.parametrize(
    ("relative", "source", "why"),
    [
        # The topology took the producer's key id from the load that signs with it.
        (
            "kbtools/chaos/rig/topology.py",
            "from kbtools.chaos.traffic.ingest import KEY_ID, public_key_b64\n",
            "upward inside kbtools.chaos",
        ),
        # The poisons' module held their check, on the invariants' names above the load.
        (
            "kbtools/chaos/traffic/poison.py",
            "from kbtools.chaos.checks.result import INGEST_POISON, CheckResult\n",
            "upward inside kbtools.chaos",
        ),
        # The fault driver reaching into the run that drives it, lazily.
        (
            "kbtools/chaos/rig/faults.py",
            "def f():\n    from kbtools.chaos.runner import ChaosOptions\n",
            "upward inside kbtools.chaos",
        ),
        # One check leaning on another beside it.
        (
            "kbtools/chaos/checks/commands.py",
            "from kbtools.chaos.checks.dead_letters import DeadLetter\n",
            "sideways inside kbtools.chaos.checks",
        ),
        # The commands' producer reaching up to the load that uses it.
        (
            "kbtools/chaos/traffic/ingest.py",
            "from kbtools.chaos.traffic.load import Published\n",
            "upward inside kbtools.chaos.traffic",
        ),
    ],
)
def test_a_chaos_back_edge_put_back_is_caught(
    tmp_path: Path, relative: str, source: str, why: str
) -> None:
    _copy_chaos(tmp_path)
    rooms = _rooms_under("kbtools.chaos")
    assert room_violations(tmp_path, rooms) == []
    with (tmp_path / relative).open("a", encoding="utf-8") as file:
        file.write(source)
    found = room_violations(tmp_path, rooms)
    assert any(v.module == relative and v.why == why for v in found), [str(v) for v in found]

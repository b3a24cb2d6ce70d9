"""Import rules: the floors of ``services`` (docs/architecture.md#layers), where the tools
(``kbtools``) and ``bench`` stand, and no import cycle in any of them.

A part of ``services`` may import its own modules and the parts on the floors below its own;
never a part above, and never a sibling on its own floor (no service imports another). Only
the top floor, where the processes and the HTTP app are composed (``app``, ``serve``,
``cli``), imports sideways.

``kbtools`` (``kb dev``, ``kb demo``, ``kb chaos``) stands beside the product, as a user of
it: it may import itself and any module of ``services``; not ``tests`` nor ``bench``. Nothing
in ``services`` imports it, lazily or for the type checker either. The one link from the
product to the tools is by name: ``services/cli.py`` names each tool's command module in a
``LazyCommand`` (``LAZILY_NAMED_TOOLS``), which ``kb`` imports only when that command runs.

``bench`` stands above all of it, as a user of the code: it may import ``bench``, any module
of ``services`` or ``kbtools`` and ``tests.support`` (the helpers tests and benchmarks
share: running pipelines, an embedding provider process, task rows); no other part of
``tests`` (fixtures, fakes, test modules), which are the tests' own. Nothing in
``services``, ``kbtools`` or ``tests.support`` imports ``bench``, nor does any test but the
bench's own (``tests/unit/bench/``): the product, its tools and its tests never depend on a
measurement.

Checked on the source, by parsing every module's imports -- lazy ones inside functions and
``TYPE_CHECKING`` blocks included -- so that no code path can break the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.stack import REPO_ROOT

# Bottom up. A part missing from every floor is a violation of its own: a new package must
# say where it stands.
FLOORS: tuple[frozenset[str], ...] = (
    frozenset({"runtime"}),  # settings, db, logging, errors, shared vocabulary
    frozenset({"index"}),  # the index's identity: generations, ANN index names
    frozenset({"embedding"}),  # embedding providers, tokens, batching
    frozenset({"publisher", "relay", "indexer", "search"}),  # the services
    frozenset({"operator"}),  # the operator page reads every service's tables
    frozenset({"app", "serve", "cli"}),  # processes and the HTTP app composed
)
TOP_FLOOR = len(FLOORS) - 1

# The development tools' package, beside services (see the module's docstring).
TOOLS = "kbtools"


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported} ({self.why})"


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    imports: list[tuple[int, str]]


def _imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` names, anywhere in the tree (lazy
    imports inside functions and ``if TYPE_CHECKING`` blocks included), relative imports
    resolved against ``package``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from services import indexer` names the module services.indexer.
            found += [(node.lineno, base)]
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def modules(root: Path, package: str = "services") -> Iterator[Module]:
    """Every module of the top-level ``package`` under ``root`` with what it imports."""
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if path.name == "__init__.py":
            name = package = ".".join(parts[:-1])
        else:
            name = ".".join(parts)
            package = name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        yield Module(name, path, _imported_modules(tree, package))


def _part(module: str) -> str | None:
    """The part of ``services`` a module belongs to (``services.indexer.queue.worker`` ->
    ``indexer``); None for the package itself and for anything outside it."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "services":
        return parts[1]
    return None


def _floor(part: str) -> int | None:
    return next((level for level, parts in enumerate(FLOORS) if part in parts), None)


def violations(root: Path) -> list[Violation]:
    """Breaches of the floors in the ``services`` package under ``root``."""
    found: list[Violation] = []
    for module in modules(root):
        importer = _part(module.name)
        if importer is None:
            continue
        where = str(module.path.relative_to(root))
        importer_floor = _floor(importer)
        if importer_floor is None:
            found.append(Violation(where, 1, module.name, f"services.{importer} has no floor"))
            continue
        for line, imported in module.imports:
            target = _part(imported)
            if target is None or target == importer:
                continue
            target_floor = _floor(target)
            if target_floor is None:
                why = f"services.{target} has no floor"
            elif target_floor > importer_floor:
                why = "upward"
            elif target_floor == importer_floor and importer_floor != TOP_FLOOR:
                why = "sideways"
            else:
                continue
            found.append(Violation(where, line, imported, why))
    return found


# The drivers, and the domain modules that talk to ports and so never import one
# (docs/architecture.md#layers says where drivers are imported instead).
DRIVERS = frozenset({"asyncpg", "aiokafka", "httpx", "onnxruntime"})
DRIVER_FREE = (
    "services/publisher/domain.py",
    "services/relay/relay.py",
    "services/indexer/task.py",
    "services/indexer/retry.py",
    "services/indexer/chunk.py",
    "services/indexer/queue/attempt.py",
    "services/indexer/queue/worker.py",
    "services/indexer/pipeline/version_indexer.py",
    "services/search/searcher.py",
    "services/indexer/ports.py",
    "services/publisher/ports.py",
    "services/relay/ports.py",
    "services/embedding/port.py",
)


def driver_imports(root: Path) -> list[Violation]:
    """Imports of a driver by a module of ``DRIVER_FREE`` (lazy and ``TYPE_CHECKING`` ones
    too: a type from the driver ties the domain to it as well)."""
    found: list[Violation] = []
    for module in modules(root):
        where = str(module.path.relative_to(root))
        if where not in DRIVER_FREE:
            continue
        for line, imported in module.imports:
            if imported.split(".")[0] in DRIVERS:
                found.append(Violation(where, line, imported, "domain code imports a driver"))
    return found


# Where bench may reach into tests, and the tests that may import bench (the bench's own).
BENCH_MAY_IMPORT_FROM_TESTS = "tests.support"
BENCH_TESTS = "tests.unit.bench"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def bench_violations(root: Path) -> list[Violation]:
    """Breaches of where ``bench`` stands: bench importing a part of ``tests`` other than
    ``tests.support``, and ``services``, ``kbtools`` or a test other than the bench's own
    importing ``bench``."""
    found: list[Violation] = []
    for module in modules(root, "bench"):
        where = str(module.path.relative_to(root))
        for line, imported in module.imports:
            # A bare `tests` is `from tests import x`'s base: x is checked on its own.
            if (
                _within(imported, "tests")
                and imported != "tests"
                and not _within(imported, BENCH_MAY_IMPORT_FROM_TESTS)
            ):
                why = f"bench imports from tests only {BENCH_MAY_IMPORT_FROM_TESTS}"
                found.append(Violation(where, line, imported, why))
    for package in ("services", TOOLS, "tests"):
        if not (root / package).is_dir():
            continue
        for module in modules(root, package):
            if _within(module.name, BENCH_TESTS):
                continue
            where = str(module.path.relative_to(root))
            for line, imported in module.imports:
                if _within(imported, "bench"):
                    found.append(Violation(where, line, imported, f"{package} imports bench"))
    return found


# The modules of the tools the composition names for `kb` (services/cli.py's LazyCommand):
# the one link from the product to the tools, made only when such a command runs.
COMPOSITION = "services/cli.py"
LAZILY_NAMED_TOOLS = frozenset({f"{TOOLS}.devstack.cli", f"{TOOLS}.demo.cli", f"{TOOLS}.chaos.cli"})
TOOLS_MAY_NOT_IMPORT = ("tests", "bench")


def _lazily_named(tree: ast.AST) -> list[tuple[int, str]]:
    """The modules named by a ``LazyCommand("<module>", ...)`` in the tree."""
    return [
        (node.lineno, node.args[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "LazyCommand"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ]


def tool_violations(root: Path) -> list[Violation]:
    """Breaches of where the tools stand: ``services`` importing them (an import anywhere,
    ``services/cli.py`` included), a module of the tools named by a ``LazyCommand`` other
    than ``LAZILY_NAMED_TOOLS`` in ``services/cli.py``, and the tools importing ``tests`` or
    ``bench``."""
    found: list[Violation] = []
    for module in modules(root):
        where = str(module.path.relative_to(root))
        for line, imported in module.imports:
            if _within(imported, TOOLS):
                found.append(Violation(where, line, imported, "services imports the tools"))
        tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
        for line, named in _lazily_named(tree):
            if not _within(named, TOOLS):
                continue
            if where != COMPOSITION or named not in LAZILY_NAMED_TOOLS:
                why = f"names a module of the tools other than {COMPOSITION}'s kb commands"
                found.append(Violation(where, line, named, why))
    if (root / TOOLS).is_dir():
        for module in modules(root, TOOLS):
            where = str(module.path.relative_to(root))
            for line, imported in module.imports:
                if any(_within(imported, package) for package in TOOLS_MAY_NOT_IMPORT):
                    why = f"the tools import only {TOOLS} and services of this repository"
                    found.append(Violation(where, line, imported, why))
    return found


def import_cycles(root: Path, package: str = "services") -> list[list[str]]:
    """The strongly connected groups of more than one module in the import graph of the
    top-level ``package`` (every import counted, lazy ones too), found with Tarjan's
    algorithm."""
    graph: dict[str, set[str]] = {}
    for module in modules(root, package):
        graph[module.name] = {imported for _, imported in module.imports}
    for name in graph:
        # `from package.x import name` names a module only when package.x.name is one.
        graph[name] = {imported for imported in graph[name] if imported in graph} - {name}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_every_import_goes_down_the_floors() -> None:
    assert [str(v) for v in violations(REPO_ROOT)] == []


def test_every_part_of_services_has_a_floor() -> None:
    parts = {
        path.stem if path.is_file() else path.name
        for path in (REPO_ROOT / "services").iterdir()
        if (path.suffix == ".py" and path.name != "__init__.py")
        or (path.is_dir() and (path / "__init__.py").exists())
    }
    assert sorted(p for p in parts if _floor(p) is None) == []


@pytest.mark.parametrize("package", ["services", "kbtools", "bench"])
def test_every_package_is_a_regular_package(package: str) -> None:
    """A folder of modules without ``__init__.py`` is a namespace package: it imports, but
    tools (mypy, the packaging, this test's module names) treat it differently."""
    folders = {
        path.parent
        for path in (REPO_ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert sorted(str(f) for f in folders if not (f / "__init__.py").exists()) == []


def test_no_import_cycle_in_services() -> None:
    assert import_cycles(REPO_ROOT) == []


def test_no_import_cycle_in_bench() -> None:
    assert import_cycles(REPO_ROOT, "bench") == []


def test_domain_code_imports_no_driver() -> None:
    assert all((REPO_ROOT / path).is_file() for path in DRIVER_FREE)
    assert [str(v) for v in driver_imports(REPO_ROOT)] == []


@pytest.mark.parametrize(
    "source",
    [
        "import asyncpg\n",
        "from aiokafka.errors import KafkaError\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import httpx\n",
        "def f():\n    import onnxruntime\n",
    ],
)
def test_the_checker_finds_a_planted_driver_in_domain_code(tmp_path: Path, source: str) -> None:
    _plant_clean_tree(tmp_path)
    # An adapter may import its driver.
    _plant(tmp_path, "services/publisher/store_pg.py", "import asyncpg\n")
    _plant(tmp_path, "services/publisher/domain.py", "from services.publisher import ports\n")
    assert driver_imports(tmp_path) == []
    _plant(tmp_path, "services/publisher/domain.py", source)
    found = driver_imports(tmp_path)
    assert found
    assert {v.module for v in found} == {"services/publisher/domain.py"}


def test_bench_stands_above_services_and_tests() -> None:
    assert [str(v) for v in bench_violations(REPO_ROOT)] == []


def _plant(root: Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")


def _plant_clean_tree(root: Path) -> None:
    _plant(root, "services/__init__.py", "")
    for part in sorted(set().union(*FLOORS)):
        if part in ("app", "serve", "cli"):
            continue
        _plant(root, f"services/{part}/__init__.py", "")
    # Allowed: down the floors, inside a part, and sideways on the top floor.
    _plant(root, "services/indexer/ok.py", "from services.runtime.indexing import tasks\n")
    _plant(root, "services/indexer/room/ok.py", "from ..ok import x\n")
    _plant(root, "services/search/ok.py", "import services.embedding.port\n")
    _plant(root, "services/embedding/ok.py", "from services.index.ann import f\n")
    _plant(root, "services/operator/ok.py", "from services.relay import outbox_pg\n")
    _plant(root, "services/cli.py", "from services.indexer import cli\nimport services.app\n")


@pytest.mark.parametrize(
    ("relative", "source", "imported", "why"),
    [
        ("services/relay/x.py", "from services.indexer.queue import task\n", "indexer", "sideways"),
        ("services/publisher/x.py", "import services.relay.relay\n", "relay", "sideways"),
        ("services/indexer/x.py", "from services import publisher\n", "publisher", "sideways"),
        ("services/indexer/x.py", "from services import search\n", "search", "sideways"),
        ("services/search/x.py", "from services.indexer import sink\n", "indexer", "sideways"),
        ("services/indexer/x.py", "from services.app import create_app\n", "app", "upward"),
        ("services/publisher/x.py", "import services.serve\n", "serve", "upward"),
        ("services/runtime/x.py", "from services.operator import routes\n", "operator", "upward"),
        ("services/index/x.py", "from services.embedding import port\n", "embedding", "upward"),
        ("services/embedding/x.py", "from services.search import searcher\n", "search", "upward"),
        ("services/operator/x.py", "from services.cli import COMMANDS\n", "cli", "upward"),
        ("services/indexer/x.py", "from services.newpart import y\n", "newpart", "no floor"),
        # Lazy, inside a function: still a dependency.
        (
            "services/runtime/x.py",
            "def f():\n    from services.indexer import worker\n    return worker\n",
            "indexer",
            "upward",
        ),
        ("services/indexer/sub/x.py", "from ...relay import relay\n", "relay", "sideways"),
        (
            "services/runtime/y.py",
            "import importlib\nm = importlib.import_module('services.publisher.web.api')\n",
            "publisher",
            "upward",
        ),
    ],
)
def test_the_checker_finds_a_planted_violation(
    tmp_path: Path, relative: str, source: str, imported: str, why: str
) -> None:
    _plant_clean_tree(tmp_path)
    assert violations(tmp_path) == []
    _plant(tmp_path, relative, source)
    found = violations(tmp_path)
    assert found, f"{relative} importing {imported} was not caught"
    assert all(_part(v.imported) == imported for v in found)
    assert all(why in v.why for v in found)
    assert {v.module for v in found} == {relative}


def test_the_checker_finds_a_part_without_a_floor(tmp_path: Path) -> None:
    _plant_clean_tree(tmp_path)
    _plant(tmp_path, "services/newpart/__init__.py", "")
    _plant(tmp_path, "services/newpart/x.py", "from services.runtime.pg import db\n")
    assert [v.why for v in violations(tmp_path)] == ["services.newpart has no floor"] * 2


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path: Path) -> None:
    _plant_clean_tree(tmp_path)
    _plant(tmp_path, "services/indexer/sink/__init__.py", "")
    _plant(tmp_path, "services/indexer/sink/a.py", "from services.indexer.sink.b import x\n")
    _plant(tmp_path, "services/indexer/sink/b.py", "from services.indexer.sink import c\n")
    assert import_cycles(tmp_path) == []
    # A lazy import closes the circle: still a cycle of dependencies.
    _plant(tmp_path, "services/indexer/sink/c.py", "def f():\n    from . import a\n")
    assert import_cycles(tmp_path) == [
        ["services.indexer.sink.a", "services.indexer.sink.b", "services.indexer.sink.c"]
    ]


def test_the_cycle_finder_finds_a_planted_cycle_in_bench(tmp_path: Path) -> None:
    _plant(tmp_path, "bench/__init__.py", "")
    _plant(tmp_path, "bench/timing.py", "import time\n")
    _plant(tmp_path, "bench/measure.py", "from bench.timing import timed\n")
    _plant(tmp_path, "bench/http.py", "from bench.measure import Row\nfrom bench import timing\n")
    assert import_cycles(tmp_path, "bench") == []
    # The circle search_scale_http <-> search_scale_measure was: closed by a lazy import.
    _plant(
        tmp_path,
        "bench/measure.py",
        "from bench.timing import timed\n\ndef run():\n    from bench.http import measure\n",
    )
    assert import_cycles(tmp_path, "bench") == [["bench.http", "bench.measure"]]
    # Closed by an import for the type checker only: still a cycle.
    _plant(
        tmp_path,
        "bench/measure.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bench.http import Row\n",
    )
    assert import_cycles(tmp_path, "bench") == [["bench.http", "bench.measure"]]


def _plant_clean_bench(root: Path) -> None:
    _plant_clean_tree(root)
    _plant(root, "bench/__init__.py", "")
    _plant(root, "tests/__init__.py", "")
    _plant(root, "tests/support/__init__.py", "")
    _plant(root, "tests/unit/bench/__init__.py", "")
    # Allowed: bench importing bench, services and tests.support; the bench's own tests
    # importing bench.
    _plant(
        root,
        "bench/ok.py",
        "from bench import other\nfrom services.indexer.wiring import x\n"
        "from tests.support.pipeline import running_pipeline\nfrom tests import support\n",
    )
    _plant(root, "tests/unit/bench/test_ok.py", "from bench.ok import x\n")
    _plant(root, "tests/unit/test_ok.py", "from tests.support import stack\n")


@pytest.mark.parametrize(
    ("relative", "source", "why"),
    [
        ("bench/x.py", "from tests.conftest import stack\n", "bench imports from tests only"),
        ("bench/x.py", "from tests import fakes\n", "bench imports from tests only"),
        (
            "bench/x.py",
            "def f():\n    import tests.integration.test_x\n",
            "bench imports from tests only",
        ),
        ("services/indexer/x.py", "from bench.pipeline import run\n", "services imports bench"),
        ("services/cli.py", "def f():\n    import bench.relay\n", "services imports bench"),
        ("tests/support/x.py", "from bench import databases\n", "tests imports bench"),
        ("tests/unit/test_x.py", "from bench.quality_metrics import mean\n", "tests imports bench"),
    ],
)
def test_the_checker_finds_a_planted_bench_violation(
    tmp_path: Path, relative: str, source: str, why: str
) -> None:
    _plant_clean_bench(tmp_path)
    assert bench_violations(tmp_path) == []
    _plant(tmp_path, relative, source)
    found = bench_violations(tmp_path)
    assert found, f"{relative} was not caught"
    assert all(why in v.why for v in found)
    assert {v.module for v in found} == {relative}


# -- the tools (kbtools): development tools beside the product --------------------------


def test_the_tools_stand_beside_services() -> None:
    assert [str(v) for v in tool_violations(REPO_ROOT)] == []


def test_no_import_cycle_in_the_tools() -> None:
    assert import_cycles(REPO_ROOT, TOOLS) == []


def test_the_lazily_named_tools_are_kb_commands() -> None:
    """Each allowed link is a ``kb`` command today: the list holds no stale name."""
    from services.cli import COMMANDS

    named = {spec.module for spec in COMMANDS.values() if _within(spec.module, TOOLS)}
    assert named == LAZILY_NAMED_TOOLS


def _plant_clean_tools(root: Path) -> None:
    _plant_clean_tree(root)
    _plant(root, "bench/__init__.py", "")
    _plant(root, "tests/__init__.py", "")
    _plant(root, "tests/support/__init__.py", "")
    _plant(root, f"{TOOLS}/__init__.py", "")
    for tool in ("chaos", "demo", "devstack"):
        _plant(root, f"{TOOLS}/{tool}/__init__.py", "")
    # Allowed: the tools importing any floor of services and each other; the composition
    # naming a tool's command module for `kb`, imported only when that command runs;
    # tests.support and bench importing the tools.
    _plant(
        root,
        f"{TOOLS}/chaos/ok.py",
        f"from {TOOLS}.demo.client import Tenant\nfrom {TOOLS}.devstack import kafka\n"
        "from services.indexer.wiring import x\nimport services.cli\n"
        "from services.runtime.pg import db\n",
    )
    _plant(
        root,
        "services/cli.py",
        "from services.indexer import cli\nimport services.app\n"
        + "".join(
            f"c{n} = LazyCommand({module!r}, 'app', 'Summary.')\n"
            for n, module in enumerate(sorted(LAZILY_NAMED_TOOLS))
        ),
    )
    _plant(root, "tests/support/ok.py", f"from {TOOLS}.devstack.settings import Settings\n")
    _plant(root, "bench/ok.py", f"from {TOOLS}.demo.processes import DemoProcesses\n")


@pytest.mark.parametrize(
    ("relative", "source", "why"),
    [
        (
            "services/publisher/x.py",
            f"from {TOOLS}.demo.client import Tenant\n",
            "services imports the tools",
        ),
        ("services/runtime/x.py", f"import {TOOLS}\n", "services imports the tools"),
        # The composition too: it names a tool's module for `kb`, never imports one.
        ("services/cli.py", f"import {TOOLS}.demo.cli\n", "services imports the tools"),
        (
            "services/serve.py",
            f"from {TOOLS}.devstack.settings import DevStackSettings\n",
            "services imports the tools",
        ),
        # Lazy, inside a function, or for the type checker only: still a dependency.
        (
            "services/indexer/x.py",
            f"def f():\n    from {TOOLS}.devstack import kafka\n",
            "services imports the tools",
        ),
        (
            "services/search/x.py",
            f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import {TOOLS}.chaos\n",
            "services imports the tools",
        ),
        (
            "services/operator/x.py",
            f"import importlib\nm = importlib.import_module('{TOOLS}.chaos.runner')\n",
            "services imports the tools",
        ),
        # A command named lazily anywhere but the composition's `kb`, or a module of the
        # tools that is not one of the allowed command modules.
        (
            "services/serve.py",
            f"c = LazyCommand('{TOOLS}.chaos.cli', 'chaos_app', 'Chaos.')\n",
            "names a module of the tools",
        ),
        (
            "services/cli.py",
            f"c = LazyCommand('{TOOLS}.chaos.runner', 'run', 'Run.')\n",
            "names a module of the tools",
        ),
        # The tools use the product; they do not reach into its tests or the benchmarks.
        (
            f"{TOOLS}/demo/x.py",
            "from tests.support.stack import REPO_ROOT\n",
            "the tools import only",
        ),
        (f"{TOOLS}/chaos/x.py", "def f():\n    import bench.latency\n", "the tools import only"),
    ],
)
def test_the_checker_finds_a_planted_tools_violation(
    tmp_path: Path, relative: str, source: str, why: str
) -> None:
    _plant_clean_tools(tmp_path)
    assert tool_violations(tmp_path) == []
    _plant(tmp_path, relative, source)
    found = tool_violations(tmp_path)
    assert found, f"{relative} was not caught"
    assert all(why in v.why for v in found), [str(v) for v in found]
    assert {v.module for v in found} == {relative}


def test_the_cycle_finder_finds_a_planted_cycle_in_the_tools(tmp_path: Path) -> None:
    _plant_clean_tools(tmp_path)
    assert import_cycles(tmp_path, TOOLS) == []
    _plant(tmp_path, f"{TOOLS}/demo/stack.py", f"from {TOOLS}.demo.processes import P\n")
    _plant(tmp_path, f"{TOOLS}/demo/processes.py", f"from {TOOLS}.devstack import process\n")
    assert import_cycles(tmp_path, TOOLS) == []
    # Across two tools, closed by a lazy import: still a cycle.
    _plant(
        tmp_path,
        f"{TOOLS}/devstack/process.py",
        f"def f():\n    from {TOOLS}.demo import stack\n",
    )
    assert import_cycles(tmp_path, TOOLS) == [
        [f"{TOOLS}.demo.processes", f"{TOOLS}.demo.stack", f"{TOOLS}.devstack.process"]
    ]


def test_bench_stands_above_the_tools_too(tmp_path: Path) -> None:
    _plant_clean_tools(tmp_path)
    assert bench_violations(tmp_path) == []
    _plant(tmp_path, f"{TOOLS}/demo/x.py", "from bench.latency import run\n")
    assert {v.module for v in bench_violations(tmp_path)} == {f"{TOOLS}/demo/x.py"}

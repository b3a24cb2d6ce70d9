"""Import rules (COMMON: how we write code): no service imports another, and the shared
runtime imports no service. Checked on the source, by parsing every module's imports --
including lazy ones inside functions -- so that no code path can break the rule."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.stack import REPO_ROOT

SERVICES = ("publisher", "relay", "indexer")


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported}"


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


def _owner(module: str) -> str | None:
    """The part of services a module belongs to: a service name, "runtime", or None."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "services":
        return parts[1]
    return None


def violations(root: Path) -> list[Violation]:
    """Rule breaches in the ``services`` package under ``root``."""
    found: list[Violation] = []
    for path in sorted((root / "services").rglob("*.py")):
        relative = path.relative_to(root).with_suffix("")
        module = ".".join(relative.parts)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        if path.name == "__init__.py":
            module = package = ".".join(relative.parts[:-1])
        importer = _owner(module)
        if importer not in (*SERVICES, "runtime"):
            continue  # the `kb` entry point and the dev stack may wire services together
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, imported in _imported_modules(tree, package):
            target = _owner(imported)
            if target in SERVICES and target != importer:
                found.append(Violation(str(path.relative_to(root)), line, imported))
    return found


def test_no_service_imports_another_and_runtime_imports_none() -> None:
    assert [str(v) for v in violations(REPO_ROOT)] == []


def _plant(root: Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")


@pytest.mark.parametrize(
    ("relative", "source", "imported"),
    [
        ("services/relay/x.py", "from services.indexer.queue.task import TaskStatus\n", "indexer"),
        ("services/publisher/x.py", "import services.relay.relay\n", "relay"),
        ("services/indexer/x.py", "from services import publisher\n", "publisher"),
        # Lazy, inside a function: still a dependency.
        (
            "services/runtime/x.py",
            "def f():\n    from services.indexer import worker\n    return worker\n",
            "indexer",
        ),
        ("services/indexer/sub/x.py", "from ...relay import relay\n", "relay"),
        (
            "services/runtime/y.py",
            "import importlib\nm = importlib.import_module('services.publisher.api')\n",
            "publisher",
        ),
    ],
)
def test_the_checker_finds_a_planted_violation(
    tmp_path: Path, relative: str, source: str, imported: str
) -> None:
    for name in (*SERVICES, "runtime"):
        _plant(tmp_path, f"services/{name}/__init__.py", "")
    _plant(tmp_path, "services/__init__.py", "")
    _plant(tmp_path, "services/indexer/ok.py", "from services.runtime import tasks\n")
    _plant(tmp_path, "services/cli.py", "from services.indexer import cli\n")  # allowed
    assert violations(tmp_path) == []
    _plant(tmp_path, relative, source)
    found = violations(tmp_path)
    assert found, f"{relative} importing {imported} was not caught"
    assert all(_owner(v.imported) == imported for v in found)
    assert {v.module for v in found} == {relative}

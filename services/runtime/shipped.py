"""The data directories that ship with the code: in a source checkout beside ``services/``,
in the wheel inside it (``services/_<name>``, see pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

from services.runtime.errors import KbError


def shipped_dir(name: str, missing: type[KbError]) -> Path:
    """``<name>/`` of a source checkout, else the copy packaged into the wheel; ``missing``
    when there is neither."""
    services = Path(__file__).resolve().parents[1]
    for candidate in (services.parent / name, services / f"_{name}"):
        if candidate.is_dir():
            return candidate
    raise missing(f"no {name} directory found")

"""Dataclass records filled field by field from what holds their values under the same
names: a row a query returned (``from_row``), or another record (``copied``).

One rule instead of a constructor call per record naming every field twice: a query names
its columns as the record's fields (aliasing where they differ), and only what is converted
or named otherwise is said where the record is made.
"""

from __future__ import annotations

from dataclasses import fields
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Record = TypeVar("Record", bound="DataclassInstance")


class Row(Protocol):
    """A row a query returned (an asyncpg record, or any mapping): its columns by name."""

    def __getitem__(self, column: str, /) -> Any: ...


@cache
def _field_names(record: type[Any]) -> tuple[str, ...]:
    # Read once per record type: rows are mapped on the claim's and the relay's hot paths.
    return tuple(field.name for field in fields(record))


def from_row(record: type[Record], row: Row, **values: Any) -> Record:
    """A ``record`` of the row's columns named as its fields; ``values`` (converted, or read
    under another name) take the place of the columns they name."""
    return record(**{n: row[n] for n in _field_names(record) if n not in values}, **values)


def copied(record: type[Record], source: object, **values: Any) -> Record:
    """A ``record`` of ``source``'s attributes named as its fields; ``values`` take the
    place of the attributes they name."""
    return record(
        **{n: getattr(source, n) for n in _field_names(record) if n not in values},
        **values,
    )

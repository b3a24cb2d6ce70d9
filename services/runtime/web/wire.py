"""The base of every JSON wire model the apps share: camelCase on the wire (snake_case in
Python, either accepted), an unknown field refused, frozen, and built from the domain's
records by attribute name."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        from_attributes=True,
    )


def wire_model_of(record: type[Any], name: str, **described: Any) -> type[ApiModel]:
    """The wire model of a domain dataclass: its fields, in its order and with its types,
    each answered as the record holds it; ``described`` gives a field a pydantic ``Field``
    (its description on the wire). One declaration of what an answer holds: the domain's."""
    types = typing.get_type_hints(record)
    unknown = set(described) - set(types)
    if unknown:
        raise ValueError(f"{record.__name__} has no field {sorted(unknown)}")
    wire_fields: dict[str, Any] = {
        field.name: (types[field.name], described.get(field.name, ...))
        for field in dataclasses.fields(record)
    }
    return create_model(name, __base__=ApiModel, **wire_fields)

"""The base of every JSON wire model the apps share: camelCase on the wire (snake_case in
Python, either accepted), an unknown field refused, frozen, and built from the domain's
records by attribute name."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        from_attributes=True,
    )

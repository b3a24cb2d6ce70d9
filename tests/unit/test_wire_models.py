"""A wire model derived from a domain dataclass: the record's fields, in its order, camelCase
on the wire, described where asked; a description of a field the record lacks is refused."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from pydantic import Field, ValidationError

from services.runtime.web.wire import wire_model_of


@dataclass(frozen=True)
class _Record:
    record_id: uuid.UUID
    error_code: str | None
    finished_at: datetime | None


def test_a_derived_wire_model_answers_the_record_field_for_field() -> None:
    model = wire_model_of(_Record, "RecordResponse", error_code=Field(description="Stable."))
    record = _Record(uuid.uuid4(), "GONE", datetime(2026, 1, 2, tzinfo=UTC))
    answer = model.model_validate(record).model_dump(mode="json", by_alias=True)
    assert list(answer) == ["recordId", "errorCode", "finishedAt"]
    assert answer["errorCode"] == "GONE"
    schema = model.model_json_schema(by_alias=True)
    assert schema["title"] == "RecordResponse"
    assert schema["properties"]["errorCode"]["description"] == "Stable."
    assert schema["required"] == ["recordId", "errorCode", "finishedAt"]
    with pytest.raises(ValidationError):
        model.model_validate({"recordId": str(uuid.uuid4()), "errorCode": None})


def test_describing_a_field_the_record_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="error_text"):
        wire_model_of(_Record, "RecordResponse", error_text=Field(description="A typo."))

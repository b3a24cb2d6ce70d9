"""``bench.span_cost`` compares like with like: the SDK's way and the lean way make the same
spans, with the same attributes, events, links and parents, for each shape it times."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

from bench import span_cost
from services.runtime.tracing import spans
from tests.support.tracing import parent_id, span_id, traced


def shape_of(made: Sequence[ReadableSpan]) -> list[tuple[Any, ...]]:
    names = {span_id(s): s.name for s in made}
    return [
        (
            s.name,
            names.get(parent_id(s) or 0, "remote" if s.parent else None),
            dict(s.attributes or {}),
            [e.name for e in s.events],
            len(s.links),
        )
        for s in made
    ]


@pytest.mark.parametrize("shape", [span_cost.search, span_cost.document])
def test_both_ways_make_the_same_spans(shape: Callable[..., None]) -> None:
    made = {}
    for way in ("sdk", "lean"):
        with traced() as exported:
            provider = trace.get_tracer_provider()
            assert isinstance(provider, TracerProvider)
            ways = (
                span_cost.sdk_ways(provider)
                if way == "sdk"
                else (spans.span_under, spans.start_span)
            )
            shape(*ways)
            made[way] = shape_of(exported.get_finished_spans())
    assert made["lean"] == made["sdk"]
    assert len(made["sdk"]) >= 3

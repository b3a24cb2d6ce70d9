"""The span of one attempt at a task (docs/operations.md#tracing).

An attempt continues the trace of the publish that created its task: the span's parent is
the context stored with the task row (migration 0034), so it is the same whether the claim
was woken by a Kafka hint or found the task by polling, and every attempt of one task (a
retry, a takeover after a crash) lands in the same trace. The Kafka message that woke the
claim, when the hint named this task, is a link (``HintContexts``).

Its children: the claim (started before the task was known, so recorded afterwards with
its own start time), the pipeline's parse-and-chunk span (linked to the embedding requests
its texts went in), and the pointer switch (linked to the group commit its result was
written in). A request and a group commit are one span each, in one of their tasks' traces.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Final

from opentelemetry import trace

from services.indexer.task import Lease
from services.runtime.tracing.propagation import traceparent_of
from services.runtime.tracing.spans import (
    LEASE_ATTEMPT,
    TASK_ID,
    document_attributes,
    links_to,
    mark_failed,
    start_span,
)

# The hints remembered for a link: more than a claim ever takes between two hints.
REMEMBERED_HINTS: Final = 1024


class HintContexts:
    """The ``traceparent`` of the latest hints, by the task they announce (bounded: the
    oldest are forgotten). Only a link: a claim is never made for a hint."""

    def __init__(self, capacity: int = REMEMBERED_HINTS) -> None:
        self._capacity = capacity
        self._by_task: OrderedDict[str, bytes] = OrderedDict()

    def remember(self, task_id: str, traceparent: bytes) -> None:
        self._by_task[task_id] = traceparent
        self._by_task.move_to_end(task_id)
        while len(self._by_task) > self._capacity:
            self._by_task.popitem(last=False)

    def take(self, task_id: str) -> bytes | None:
        return self._by_task.pop(task_id, None)


@dataclass(frozen=True)
class Claimed:
    """How an attempt began: when its claim did (ns since the epoch), and the trace context
    of the Kafka hint that named its task, if one did."""

    started_ns: int
    hint: bytes | None = None


class AttemptSpan:
    """Started at the claim, ended when the attempt's result is written (or it is given
    up). ``lease`` is the claimed lease carrying this span's context: what the attempt
    writes (the switch's event) continues from it."""

    def __init__(self, lease: Lease, owner: str, claimed: Claimed | None) -> None:
        hint = claimed.hint if claimed is not None else None
        started = claimed.started_ns if claimed is not None else time.time_ns()
        attributes = {
            **document_attributes(lease.tenant_id, lease.document_id, lease.version_number),
            TASK_ID: str(lease.task_id),
            LEASE_ATTEMPT: lease.lease_attempt,
            "kb.tier": lease.tier,
            "kb.indexer.owner": owner,
            "kb.claim.woken_by": "hint" if hint is not None else "poll",
        }
        self.span = start_span(
            "kb.index.attempt",
            lease.traceparent,
            attributes=attributes,
            links=links_to(hint),
            start_time=started,
        )
        own = traceparent_of(self.span.get_span_context())
        self.lease = replace(lease, traceparent=own or lease.traceparent)
        if claimed is not None:
            # The claim took the task before anyone knew which: its span, afterwards.
            claim = start_span(
                "kb.index.claim",
                own,
                attributes={TASK_ID: str(lease.task_id), LEASE_ATTEMPT: lease.lease_attempt},
                start_time=started,
            )
            claim.end()

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The span as the current one (its children, its log lines' ids), not ended."""
        with trace.use_span(
            self.span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        ):
            yield

    def end(self, result: str, error: BaseException | str | None = None) -> None:
        self.span.set_attribute("kb.attempt.result", result)
        if isinstance(error, BaseException):
            mark_failed(self.span, error)
        elif error is not None:
            self.span.set_attribute("error.type", error)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR))
        self.span.end()


def claimed_now(hint: bytes | None = None) -> Claimed:
    """A claim beginning now."""
    return Claimed(time.time_ns(), hint)

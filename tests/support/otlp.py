"""A small OTLP/HTTP trace receiver for tests: processes export to it as to a collector
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); it decodes each ``ExportTraceServiceRequest``
(protobuf) and keeps the spans, which a test waits for by condition, never by time."""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    links: list[str] = field(default_factory=list)  # the span ids linked to
    ended: bool = True
    events: tuple[str, ...] = ()  # the names of its events, in order
    # Every text the span carries (names, attribute values, events), for content scans.
    texts: tuple[str, ...] = ()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes = _attributes(span.attributes)
                texts = [span.name, span.status.message, *map(str, resource.values())]
                texts += [f"{k}={v}" for k, v in attributes.items()]
                for event in span.events:
                    texts.append(event.name)
                    texts += [f"{k}={v}" for k, v in _attributes(event.attributes).items()]
                for link in span.links:
                    texts += [f"{k}={v}" for k, v in _attributes(link.attributes).items()]
                spans.append(
                    ReceivedSpan(
                        service=service,
                        name=span.name,
                        kind=span.kind,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes=attributes,
                        links=[link.span_id.hex() for link in span.links],
                        events=tuple(event.name for event in span.events),
                        texts=tuple(texts),
                    )
                )
    return spans


class Receiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.url = ""

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self.spans.extend(spans)
            self._changed.notify_all()

    async def wait_for(
        self, found: Callable[[list[ReceivedSpan]], bool], within: float = 120.0
    ) -> list[ReceivedSpan]:
        """Every span received once ``found`` holds for them (AssertionError after
        ``within`` seconds)."""

        def wait() -> list[ReceivedSpan]:
            with self._changed:
                if not self._changed.wait_for(lambda: found(list(self.spans)), within):
                    names = sorted({s.name for s in self.spans})
                    raise AssertionError(f"spans not received in {within}s; have {names}")
                return list(self.spans)

        return await asyncio.to_thread(wait)

    def in_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._changed:
            return [s for s in self.spans if s.trace_id == trace_id]


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            receiver.add(decode(body))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

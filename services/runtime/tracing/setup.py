"""``configure_tracing``: the one call every process makes (`kb serve`, `kb relay run`,
`kb indexer run`), from the standard OpenTelemetry variables alone.

Off unless configured, so a deployment that never heard of tracing pays nothing (the API's
no-op tracer, no ``traceparent`` stored): tracing is on when an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``) or
``OTEL_TRACES_EXPORTER`` is ``otlp``, and ``OTEL_SDK_DISABLED`` is not ``true`` and
``OTEL_TRACES_EXPORTER`` not ``none``. (The SDK's own default would export to
localhost:4318 whether anything listens there or not.)

The rest is the SDK's and the exporters' own reading of the standard variables: the
protocol (``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``: ``http/protobuf``, the default, or
``grpc``), endpoint, headers, timeout and compression, the sampler
(``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``, parent-based always-on by default),
the batch processor (``OTEL_BSP_*``), the resource (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``). Spans are exported in the background and flushed when the
process exits (the provider's exit hook).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from services.runtime.errors import ConfigError

PROTOCOLS: Final = ("http/protobuf", "grpc")

# The standard variables a process's tracing reads (here, or in the SDK and its exporters):
# not KB_ settings, documented in docs/configuration.md#tracing-opentelemetry.
ENV_NAMES: Final = frozenset(
    {
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "OTEL_EXPORTER_OTLP_COMPRESSION",
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_BSP_SCHEDULE_DELAY",
        "OTEL_BSP_MAX_QUEUE_SIZE",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
        "OTEL_BSP_EXPORT_TIMEOUT",
        "OTEL_SEMCONV_STABILITY_OPT_IN",
    }
)


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool
    protocol: str = "http/protobuf"


def tracing_config(environ: Mapping[str, str] = os.environ) -> TracingConfig:
    """What the ``OTEL_*`` variables ask for; a protocol we cannot speak is a ConfigError
    (the process does not start), not a silent fallback."""
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if disabled:
        return TracingConfig(enabled=False)
    if exporter not in ("", "otlp", "none"):
        raise ConfigError(f"OTEL_TRACES_EXPORTER must be otlp or none, not {exporter!r}")
    if exporter == "none" or not (endpoint or exporter == "otlp"):
        return TracingConfig(enabled=False)
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of {', '.join(PROTOCOLS)},"
            f" not {protocol!r}"
        )
    return TracingConfig(enabled=True, protocol=protocol)


_configured: TracerProvider | None = None


def configure_tracing(
    service: str,
    *,
    environ: Mapping[str, str] = os.environ,
    processor: SpanProcessor | None = None,
) -> bool:
    """Install the process's tracer provider when tracing is configured (or ``processor``
    is given: tests export to memory); whether tracing is on. Once per process: the global
    provider cannot be replaced, so a second call keeps the first."""
    global _configured
    if _configured is not None:
        return True
    if processor is None:
        config = tracing_config(environ)
        if not config.enabled:
            return False
        processor = BatchSpanProcessor(_otlp_exporter(config.protocol))
    # OTEL_SERVICE_NAME, when set, names the service; ours otherwise.
    named = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service}
    provider = TracerProvider(resource=_HashedOnce.of(Resource.create(named)))
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _configured = provider
    return True


class _HashedOnce(Resource):
    """The process's resource, its hash computed once: the OTLP encoder groups every span
    by its resource, and the SDK's hash serialises the attributes to JSON each time (a
    sixth of a span's encoding)."""

    _hash: int

    @classmethod
    def of(cls, resource: Resource) -> Resource:
        hashed = cls(resource.attributes, resource.schema_url)
        hashed._hash = hash(resource)
        return hashed

    def __hash__(self) -> int:
        return self._hash


def tracing_on() -> bool:
    """Whether ``configure_tracing`` installed a provider in this process."""
    return _configured is not None


def flush_tracing(timeout_millis: int = 5_000) -> bool:
    """Export every ended span now (tests; the exit hook does it at the end anyway)."""
    return _configured is None or _configured.force_flush(timeout_millis)


def _otlp_exporter(protocol: str) -> SpanExporter:
    # Imported on demand: a process that does not trace never loads gRPC.
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter()

"""Distributed tracing (OpenTelemetry): one document's path from its publish to the moment
search serves it, as one trace (docs/operations.md#tracing).

- ``setup.py``: ``configure_tracing``, the one call every process makes; the standard
  ``OTEL_*`` variables decide everything, and tracing is off unless an exporter is
  configured;
- ``propagation.py``: the W3C ``traceparent`` of the current span, stored with outbox and
  task rows and sent as a Kafka header, and the context read back from one;
- ``spans.py``: the tracer, and the attribute names the services put on their spans (ids
  only: never a document's text, a title, a principal, a key or a credential);
- ``lean.py``: the span the services' own spans are (``spans.start_span``): the SDK's
  sampler, ids, limits, resource and processors, without the SDK span's general costs;
  its processors receive the SDK's ``ReadableSpan`` as from the SDK's span;
- ``logs.py``: the structlog processor that puts ``trace_id``/``span_id`` on log lines.
"""

"""Settings of the publisher (HTTP API): ``KB_PUBLISHER_*``, durations in ``*_SECONDS``."""

from __future__ import annotations

from pydantic import AliasChoices, Field

from services.runtime.settings import RuntimeSettings

MIB = 1024 * 1024


class PublisherSettings(RuntimeSettings):
    # The largest document file accepted; larger uploads get 413. KB_MAX_UPLOAD_BYTES is the
    # deprecated name of KB_PUBLISHER_MAX_UPLOAD_BYTES.
    publisher_max_upload_bytes: int = Field(
        default=25 * MIB,
        ge=1,
        le=1024 * MIB,
        validation_alias=AliasChoices("KB_PUBLISHER_MAX_UPLOAD_BYTES", "KB_MAX_UPLOAD_BYTES"),
    )
    # What a request's multipart framing may add on top of the file itself.
    publisher_max_request_overhead_bytes: int = Field(default=64 * 1024, ge=1024)
    # The largest body of any request that is not a multipart upload (publish's JSON).
    publisher_max_json_body_bytes: int = Field(default=16 * 1024, ge=1024, le=MIB)
    # Upload bytes the whole process admits at once (declared, or the limit when undeclared);
    # an upload beyond it gets 503 with Retry-After, its body never held. The process holds
    # a few times these bytes while they are stored (the file read whole, the driver's
    # copy): the default bounds a publisher's memory with a few large uploads in flight.
    publisher_max_inflight_upload_bytes: int = Field(default=128 * MIB, ge=1)
    # The Retry-After of that 503.
    publisher_retry_after_seconds: int = Field(default=2, ge=1, le=3600)
    # How long a request may leave its body stalled (no bytes) before it gets 408.
    publisher_body_read_timeout_seconds: float = Field(default=60.0, gt=0, le=600)
    # How long a request waits for a database connection before answering 503.
    publisher_db_acquire_timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    # /readyz answers from a cached check this young; the check itself is bounded.
    publisher_readiness_cache_seconds: float = Field(default=1.0, ge=0, le=60)
    publisher_readiness_timeout_seconds: float = Field(default=2.0, gt=0, le=60)
    # uvicorn: connections + tasks beyond this get uvicorn's plain 503 (a backstop: the
    # upload budget answers first, with problem+json and Retry-After).
    publisher_limit_concurrency: int = Field(default=1000, ge=1)
    # A connection whose request head (request line + headers) takes longer is closed.
    publisher_request_head_timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    # uvicorn: idle keep-alive connections are closed after this.
    publisher_keep_alive_seconds: float = Field(default=5.0, gt=0, le=300)
    # uvicorn (h11): the largest request head (request line + headers).
    publisher_max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=MIB)

    # An erase removes a document's content in batches of at most this many rows, each its
    # own short transaction (docs/architecture.md#document-lifecycle): a large document's
    # erase holds no lock a publish or a search waits for.
    publisher_erase_batch_rows: int = Field(default=1000, ge=1, le=100_000)

    @property
    def max_request_bytes(self) -> int:
        return self.publisher_max_upload_bytes + self.publisher_max_request_overhead_bytes

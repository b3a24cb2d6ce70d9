"""Settings of the publisher (HTTP API)."""

from __future__ import annotations

from pydantic import Field

from services.runtime.settings import RuntimeSettings


class PublisherSettings(RuntimeSettings):
    # The largest document file accepted (KB_MAX_UPLOAD_BYTES); larger uploads get 413.
    max_upload_bytes: int = Field(default=25 * 1024 * 1024, ge=1, le=1024 * 1024 * 1024)
    # What a request's multipart/JSON framing may add on top of the file itself.
    max_request_overhead_bytes: int = Field(default=64 * 1024, ge=1024)

    # How long a request waits for a database connection before answering 503.
    db_acquire_timeout_s: float = Field(default=10.0, gt=0, le=300)

    @property
    def max_request_bytes(self) -> int:
        return self.max_upload_bytes + self.max_request_overhead_bytes

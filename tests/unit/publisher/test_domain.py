"""Publisher domain rules that need no database."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from services.publisher.cli import TIER_PATTERN
from services.publisher.domain import (
    IndexStatus,
    RevisionConflict,
    Upload,
    check_principals,
    check_title,
    check_upload,
    derive_status,
    resolve_media_type,
    tenant_task_view,
)
from services.publisher.failures import INTERNAL_FAILURE_MESSAGE
from services.publisher.ports import DocumentStatusRecord
from services.runtime.errors import (
    BadInput,
    PayloadTooLarge,
    UnsupportedMediaType,
    ValidationFailed,
)
from services.runtime.indexing.media_types import SUPPORTED_MEDIA_TYPES
from services.runtime.indexing.tasks import IndexTaskRecord, TaskStatus
from services.runtime.messaging.avro import default_registry
from services.runtime.messaging.events import (
    DOCUMENT_DELETED,
    DOCUMENT_INDEXING_FAILED,
    DOCUMENT_SEARCH_VERSION_SWITCHED,
    DOCUMENT_VERSION_PUBLISHED,
    INDEX_TASK_CREATED,
    event_id,
)
from services.runtime.tenancy.tenant_auth import (
    bearer_token,
    hash_api_key,
    new_api_key,
    parse_api_key,
)
from services.runtime.tenancy.tenant_ids import TENANT_ID_PATTERN

NOW = datetime(2026, 3, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("declared", "filename", "expected"),
    [
        ("text/plain", "a.bin", "text/plain"),
        ("TEXT/HTML; charset=utf-8", None, "text/html"),
        ("text/x-markdown", "a", "text/markdown"),
        ("application/octet-stream", "Guide.MD", "text/markdown"),
        (None, "report.pdf", "application/pdf"),
        ("", "letter.docx", next(t for t in SUPPORTED_MEDIA_TYPES if "wordprocessingml" in t)),
    ],
)
def test_media_type_resolution(declared: str | None, filename: str | None, expected: str) -> None:
    assert resolve_media_type(declared, filename) == expected


@pytest.mark.parametrize(
    ("declared", "filename"),
    [
        ("image/png", "a.txt"),  # a precise type is believed, not the extension
        ("application/octet-stream", "a.exe"),
        ("application/octet-stream", None),
        (None, "noextension"),
        ("application/msword", "old.doc"),
    ],
)
def test_what_the_indexer_cannot_parse_is_415(declared: str | None, filename: str | None) -> None:
    with pytest.raises(UnsupportedMediaType) as caught:
        resolve_media_type(declared, filename)
    assert caught.value.http_status == 415


def test_upload_checks() -> None:
    with pytest.raises(BadInput) as empty:
        check_upload(Upload(b"", "text/plain", "a.txt"), 10)
    assert empty.value.code == "EMPTY_FILE"
    assert empty.value.http_status == 400
    with pytest.raises(PayloadTooLarge):
        check_upload(Upload(b"x" * 11, "text/plain", "a.txt"), 10)
    assert check_upload(Upload(b"x" * 10, "text/plain", "a.txt"), 10) == "text/plain"


def test_titles_and_principals() -> None:
    assert check_title("  Refunds  ") == "Refunds"
    for bad in ["", "   ", "x" * 501, "a\x00b", "line\nbreak"]:
        with pytest.raises(ValidationFailed):
            check_title(bad)
    assert check_principals(["a", " a ", "b"]) == frozenset({"a", "b"})
    for bad_list in [[""], ["  "], ["x" * 201]]:
        with pytest.raises(ValidationFailed):
            check_principals(bad_list)


def test_revision_conflict_tells_the_current_revision() -> None:
    error = RevisionConflict(expected=2, current=5)
    assert error.http_status == 409
    assert error.problem_fields == {"currentRevision": 5}


def test_event_ids_are_stable_per_change() -> None:
    doc = uuid.uuid4()
    first = event_id(DOCUMENT_VERSION_PUBLISHED, "acme", doc, 2)
    assert first == event_id(DOCUMENT_VERSION_PUBLISHED, "acme", doc, 2)
    assert first != event_id(DOCUMENT_VERSION_PUBLISHED, "acme", doc, 3)
    assert first != event_id(INDEX_TASK_CREATED, "acme", doc, 2)


def test_the_event_type_names_are_the_schemas() -> None:
    assert default_registry().event_types == {
        INDEX_TASK_CREATED,
        DOCUMENT_VERSION_PUBLISHED,
        DOCUMENT_SEARCH_VERSION_SWITCHED,
        DOCUMENT_DELETED,
        DOCUMENT_INDEXING_FAILED,
    }


def _task(status: str, **changes: object) -> IndexTaskRecord:
    fields: dict[str, object] = {
        "task_id": uuid.uuid4(),
        "tenant_id": "acme",
        "document_id": uuid.uuid4(),
        "version_number": 2,
        "task_type": "INDEX_VERSION",
        "tier": "standard",
        "status": TaskStatus(status),
        "attempts": 1,
        "max_attempts": 8,
        "lease_owner": None,
        "lease_until": None,
        "next_attempt_at": NOW,
        "error_code": None,
        "error_message": None,
        "created_at": NOW,
        "updated_at": NOW,
        "finished_at": None,
    }
    fields.update(changes)
    return IndexTaskRecord(**fields)  # type: ignore[arg-type]


def _record(
    published: int | None, search: int | None, task: IndexTaskRecord | None
) -> DocumentStatusRecord:
    return DocumentStatusRecord(
        document_id=uuid.uuid4(),
        title="t",
        revision=3,
        latest_version=2,
        published_version=published,
        published_at=NOW if published else None,
        search_version=search,
        search_switched_at=NOW - timedelta(days=1) if search else None,
        deleted_at=None,
        task=task,
    )


def test_index_status() -> None:
    assert derive_status(_record(None, None, None)).index_status is IndexStatus.NOT_PUBLISHED
    for status in ("PENDING", "RUNNING", "RETRY_WAIT", "SUCCEEDED"):
        derived = derive_status(_record(2, 1, _task(status)))
        assert derived.index_status is IndexStatus.INDEXING
        assert derived.search_lag_since == NOW
        assert derived.failure is None
    searchable = derive_status(_record(2, 2, _task("SUCCEEDED")))
    assert searchable.index_status is IndexStatus.SEARCHABLE
    assert searchable.search_lag_since is None

    dead = _task(
        "DEAD",
        error_code="DOCUMENT_PARSE_FAILED",
        error_message="bad xref",
        finished_at=NOW + timedelta(minutes=1),
    )
    failed = derive_status(_record(2, 1, dead))
    assert failed.index_status is IndexStatus.FAILED
    assert failed.failure is not None
    assert failed.failure.error_code == "DOCUMENT_PARSE_FAILED"
    # The stored text is for operators; the tenant reads the fixed text of the code.
    assert failed.failure.message == "The document could not be parsed."
    assert failed.failure.failed_at == NOW + timedelta(minutes=1)
    assert failed.index_task_id == dead.task_id
    assert failed.search_version == 1


def test_api_keys_name_their_tenant_and_are_stored_hashed() -> None:
    key = new_api_key("acme-eu")
    presented = parse_api_key(key)
    assert presented is not None
    assert presented.tenant_id == "acme-eu"
    assert presented.key_hash == hash_api_key(key)
    assert len(presented.key_hash) == 32
    assert new_api_key("acme-eu") != key
    for bad in [
        "",
        "kb.acme",
        "kb.acme.short",
        f"{key}\n",
        "xx.acme." + "a" * 43,
        f"kb.ACME.{'a' * 43}",
    ]:
        assert parse_api_key(bad) is None


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    for bad in [None, "", "Bearer", "Bearer   ", "Basic abc", "abc"]:
        assert bearer_token(bad) is None


def test_tenant_names_and_tiers() -> None:
    for good in ["acme", "acme-eu", "a", "0day", "a" * 63]:
        assert re.fullmatch(TENANT_ID_PATTERN, good), good
    for bad in ["", "Acme", "-acme", "a" * 64, "acme_eu", "acme.eu", "acme eu", "acme\n"]:
        assert not re.fullmatch(TENANT_ID_PATTERN, bad), bad
    for good in ["standard", "premium", "tier_2", "a" * 32]:
        assert re.fullmatch(TIER_PATTERN, good), good
    for bad in ["", "Gold", "gold plus", "-x", "a" * 33]:
        assert not re.fullmatch(TIER_PATTERN, bad), bad


def test_a_tenant_never_sees_the_lease_owner_or_the_stored_error_text() -> None:
    internal = _task(
        "DEAD",
        lease_owner="worker-7.internal:4242:ab12",
        error_code="INTERNAL_ERROR",
        error_message='relation "knowledge_chunk" violates constraint kc_pkey',
    )
    view = tenant_task_view(internal)
    assert not hasattr(view, "lease_owner")
    assert view.error_code == "INTERNAL_ERROR"
    assert view.error_message == INTERNAL_FAILURE_MESSAGE
    assert "knowledge_chunk" not in repr(view)
    assert "worker-7" not in repr(view)
    failed = derive_status(_record(2, 1, internal))
    assert failed.failure is not None
    assert failed.failure.message == INTERNAL_FAILURE_MESSAGE
    unknown = tenant_task_view(_task("DEAD", error_code="SOMETHING_NEW", error_message="x"))
    assert unknown.error_message == INTERNAL_FAILURE_MESSAGE
    running = tenant_task_view(_task("RUNNING", lease_owner="host:1"))
    assert running.error_code is None
    assert running.error_message is None

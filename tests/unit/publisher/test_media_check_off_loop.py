"""The upload's content check runs in a worker thread, never on the event loop (issue 41):
while one upload's bytes are decoded, the loop serves everyone else. In bulk an item whose
check fails is refused alone, whatever the check raised."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

import pytest

from services.publisher import domain
from services.publisher.bulk.domain import BulkItem, BulkPublisher, ItemPublished, ItemRefused
from services.publisher.domain import Publisher, Upload
from services.publisher.ingest.apply import IngestApplier
from services.publisher.ingest.commands import Command, decode_command
from services.publisher.ports import PendingEvent
from services.runtime.indexing.media_types import check_content, run_media_check
from tests.fakes.publisher_store import MemoryPublisherStore
from tests.support.ingest import delete_command, publish_command

# Only a safety net for a regression (the check back on the loop): it never paces the test.
_DEADLOCK_SECONDS = 30.0


class _MemoryBulkStore:
    def __init__(self) -> None:
        self.written: list[Any] = []

    async def tenant_tier(self, tenant_id: str) -> str:
        return "standard"

    async def insert_published_documents(
        self,
        tenant_id: str,
        tier: str,
        documents: Sequence[Any],
        events: Sequence[PendingEvent],
        now: Any,
    ) -> None:
        self.written.extend(documents)


@pytest.fixture
def store() -> MemoryPublisherStore:
    store = MemoryPublisherStore()
    store.add_tenant("acme", "standard", b"\x00" * 32)
    return store


async def _check_runs_while_the_loop_is_free(
    monkeypatch: pytest.MonkeyPatch, call: Callable[[], Coroutine[Any, Any, Any]]
) -> Any:
    """Runs ``call`` with a content check that blocks until the loop answers: it can only
    finish if the loop keeps running while the check does."""
    started = threading.Event()
    release = threading.Event()
    threads: list[threading.Thread] = []
    real = check_content

    def blocking_check(media_type: str, content: bytes, *, charset: str | None = None) -> None:
        threads.append(threading.current_thread())
        started.set()
        if not release.wait(_DEADLOCK_SECONDS):
            raise AssertionError("the event loop was blocked by the content check")
        real(media_type, content, charset=charset)

    monkeypatch.setattr(domain, "check_content", blocking_check)
    task: asyncio.Task[Any] = asyncio.create_task(call())
    # The loop itself answers: it waits for the check to start, then releases it.
    await asyncio.to_thread(started.wait, _DEADLOCK_SECONDS)
    release.set()
    result = await task
    assert threads
    assert threading.main_thread() not in threads
    return result


async def test_an_uploads_check_runs_off_the_loop(
    store: MemoryPublisherStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    publisher = Publisher(store, max_upload_bytes=1024)
    upload = Upload(b"Refunds within 30 days.", "text/plain", "a.txt")
    created = await _check_runs_while_the_loop_is_free(
        monkeypatch, lambda: publisher.create_document("acme", "Refunds", upload)
    )
    assert created.version_number == 1
    added = await _check_runs_while_the_loop_is_free(
        monkeypatch, lambda: publisher.add_version("acme", created.document_id, upload)
    )
    assert added.version_number == 2


async def test_a_bulk_items_check_runs_off_the_loop(
    store: MemoryPublisherStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    publisher = Publisher(store, max_upload_bytes=1024)
    bulk = BulkPublisher(publisher, _MemoryBulkStore(), max_upload_bytes=1024)
    item = BulkItem(Upload(b"Refunds.", "text/plain", "a.txt"), ["g"], title="Refunds")
    (result,) = await _check_runs_while_the_loop_is_free(
        monkeypatch, lambda: bulk.publish_many("acme", [item])
    )
    assert isinstance(result, ItemPublished)


async def test_in_bulk_an_unreadable_charset_refuses_its_item_alone(
    store: MemoryPublisherStore,
) -> None:
    publisher = Publisher(store, max_upload_bytes=1 << 20)
    bulk_store = _MemoryBulkStore()
    bulk = BulkPublisher(publisher, bulk_store, max_upload_bytes=1 << 20)

    def page(charset: str) -> BulkItem:
        content = f'<meta charset="{charset}"><p>hello</p>'.encode()
        return BulkItem(Upload(content, "text/html", "p.html"), ["g"], title=charset)

    charsets = ["utf-8", "hex", "utf-8", "bz2", "rot13", "punycode", "undefined", "utf-7"]
    results = await bulk.publish_many("acme", [page(charset) for charset in charsets])
    refused = {r.index: r.error for r in results if isinstance(r, ItemRefused)}
    assert sorted(refused) == [1, 3, 4, 5, 6, 7]
    assert {(e.code, e.http_status) for e in refused.values()} == {("MEDIA_TYPE_MISMATCH", 415)}
    assert [d.title for d in bulk_store.written] == ["utf-8", "utf-8"]


def _command(value: bytes) -> Command:
    return decode_command(value, max_inline_bytes=1 << 20)


async def test_a_runs_checks_take_one_trip_off_the_loop_each_refused_alone(
    store: MemoryPublisherStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A trip to the media check's threads per command cost the ingest loop more than the
    # checks: a run's commands go in one, and a bad one among them is refused alone.
    trips: list[int] = []
    real = run_media_check

    async def counted(check: Callable[..., Any], uploads: list[Any], limit: int) -> Any:
        trips.append(len(uploads))
        return await real(check, uploads, limit)

    monkeypatch.setattr("services.publisher.ingest.apply.run_media_check", counted)
    applier = IngestApplier(
        Publisher(store, max_upload_bytes=1024), cast(Any, None), max_upload_bytes=1024
    )
    commands = [
        _command(publish_command("acme", "a", b"Refunds.")),
        _command(publish_command("acme", "b", b"")),
        _command(delete_command("acme", "c")),
        _command(publish_command("acme", "d", b"x" * 2048)),
    ]
    checked = await applier.media_types(commands)
    assert trips == [4]
    assert checked[0] == "text/plain"
    assert checked[2] is None
    assert [getattr(c, "code", None) for c in (checked[1], checked[3])] == [
        "EMPTY_FILE",
        "PAYLOAD_TOO_LARGE",
    ]


async def test_a_runs_checks_run_off_the_loop(
    store: MemoryPublisherStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    applier = IngestApplier(
        Publisher(store, max_upload_bytes=1024), cast(Any, None), max_upload_bytes=1024
    )
    command = _command(publish_command("acme", "a", b"Refunds."))
    checked = await _check_runs_while_the_loop_is_free(
        monkeypatch, lambda: applier.media_types([command])
    )
    assert checked == ["text/plain"]

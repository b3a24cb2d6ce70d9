"""The publisher's rules on the in-memory store (held to the PostgreSQL adapter's behaviour by
tests/contract/test_publish_store_contract.py): fast, and explorable with hypothesis."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from services.publisher.domain import Publisher, Upload
from services.runtime.errors import KbError
from services.runtime.messaging.avro import default_registry
from tests.fakes.publisher_store import MemoryPublisherStore


def _publisher() -> tuple[Publisher, MemoryPublisherStore]:
    store = MemoryPublisherStore()
    store.add_tenant("acme", "standard", b"\x00" * 32)
    return Publisher(store, max_upload_bytes=1024), store


async def test_every_event_decodes_and_names_its_change() -> None:
    publisher, store = _publisher()
    created = await publisher.create_document("acme", "Refunds", Upload(b"v1", "text/plain", None))
    first = await publisher.publish(
        "acme", created.document_id, 1, expected_revision=1, read_principals=["b", "a", "a"]
    )
    await publisher.publish(
        "acme", created.document_id, 1, expected_revision=2, read_principals=["a"]
    )
    events = store.events()
    assert [e.event_type for e in events] == [
        "IndexTaskCreated",
        "DocumentVersionPublished",
        "DocumentVersionPublished",
    ]
    decoded = [default_registry().decode(e.payload).record for e in events]
    for event, record in zip(events, decoded, strict=True):
        assert record["eventId"] == event.event_id
        assert record["documentId"] == created.document_id == event.document_id
        assert event.tier == record["tier"] == "standard"
    assert decoded[0]["taskId"] == first.index_task_id
    assert decoded[1]["readPrincipals"] == ["a", "b"]
    assert (decoded[1]["revision"], decoded[2]["revision"]) == (2, 3)
    assert decoded[2]["readPrincipals"] == ["a"]
    assert decoded[1]["sha256"] == __import__("hashlib").sha256(b"v1").hexdigest()


@dataclass
class Model:
    """What the rules say the state must be, tracked independently of the store."""

    revision: int = 1
    latest: int = 1
    published: int | None = None
    acl: frozenset[str] = frozenset()
    tasks: dict[int, uuid.UUID] = field(default_factory=dict)
    changes: int = 0


_step = st.one_of(
    st.tuples(st.just("upload"), st.just(0), st.just(0), st.just(frozenset[str]())),
    st.tuples(
        st.just("publish"),
        st.integers(min_value=1, max_value=4),  # version
        st.integers(min_value=-1, max_value=1),  # revision offset: stale, current, ahead
        st.frozensets(st.sampled_from(["a", "b", "c"]), max_size=3),
    ),
)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(_step, max_size=25))
def test_any_sequence_of_uploads_and_publishes_keeps_the_invariants(
    steps: list[tuple[str, int, int, frozenset[str]]],
) -> None:
    asyncio.run(_run(steps))


async def _run(steps: list[tuple[str, int, int, frozenset[str]]]) -> None:
    publisher, store = _publisher()
    created = await publisher.create_document("acme", "Doc", Upload(b"v1", "text/plain", None))
    doc = created.document_id
    model = Model()
    for kind, version, offset, acl in steps:
        if kind == "upload":
            result = await publisher.add_version("acme", doc, Upload(b"v", "text/plain", None))
            model.latest += 1
            model.revision += 1
            assert (result.version_number, result.revision) == (model.latest, model.revision)
            continue
        revision = model.revision + offset
        refused: str | None = None
        try:
            outcome = await publisher.publish(
                "acme", doc, version, expected_revision=revision, read_principals=sorted(acl)
            )
        except KbError as error:
            refused = error.code
        if refused is not None:
            unchanged = model.published == version and model.acl == acl
            expected = (
                "VERSION_NOT_FOUND"
                if version > model.latest
                else "REVISION_CONFLICT"
                if not unchanged and offset != 0
                else "VERSION_SUPERSEDED"
            )
            assert refused == expected, model
            continue
        assert version <= model.latest
        if model.published == version and model.acl == acl:
            assert not outcome.changed  # a repeat: nothing new, whatever revision it sent
            assert outcome.revision == model.revision
        else:
            assert offset == 0
            assert model.published is None or version >= model.published
            model.revision += 1
            model.changes += 1
            model.published, model.acl = version, acl
            assert outcome.changed
            assert outcome.revision == model.revision
        # One task per version, however often it is published.
        assert model.tasks.setdefault(version, outcome.index_task_id) == outcome.index_task_id

    status = await publisher.document_status("acme", doc)
    assert (status.revision, status.latest_version, status.published_version) == (
        model.revision,
        model.latest,
        model.published,
    )
    types = [e.event_type for e in store.events()]
    assert types.count("IndexTaskCreated") == len(model.tasks)
    assert types.count("DocumentVersionPublished") == model.changes
    assert len({e.event_id for e in store.events()}) == len(types)

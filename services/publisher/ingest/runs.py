"""A tenant's run of commands in one transaction (docs/architecture.md#publish-by-event).

Each command applies in a savepoint of its own: a refused one is undone alone, its dead
letter sent and recorded by its source in the same transaction (migration 0036), so a run
redelivered after its commit neither applies nor dead-letters anything twice. Commands
that publish a new document (a key no document has, inline content) are written together,
one statement per table as the bulk endpoint writes them (services/publisher/bulk/), in a
savepoint of their own; should one of them be refused, they are applied one by one as any
command. Commands after them in the run apply after them: the run keeps its order.

No driver here: storage is the ``IngestStore`` port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime

from services.publisher.bulk.domain import (
    PUBLISHED_REVISION,
    new_document_events,
    new_published_document,
)
from services.publisher.domain import check_principals, check_title
from services.publisher.ingest.apply import IngestApplier
from services.publisher.ingest.commands import Command, DeleteDocument, PublishDocument
from services.publisher.ingest.ports import CommandAnswer, IngestStore, IngestTransaction
from services.runtime.errors import KbError
from services.runtime.messaging.avro import SchemaRegistry, default_registry
from services.runtime.tracing.propagation import current_traceparent


@dataclass(frozen=True)
class Arrived:
    """A verified command of a run, with where and when its record reached Kafka."""

    command: Command
    source: str
    sent_at: datetime | None = None


# Sends the dead letter of the run's n-th command, refused with the error, and waits for
# the broker's acknowledgement (a retriable error when it does not come).
Refuse = Callable[[int, KbError], Awaitable[None]]
# Entered around the run's n-th command (its span: the rows it writes keep its context).
Around = Callable[[int], AbstractContextManager[object]]
# Told that the run's n-th command was refused, with this code, when the run ran before:
# its dead letter was sent then and is not sent again.
RefusedBefore = Callable[[int, str], None]


class _OneByOne(Exception):
    """The new documents cannot be written together: each is applied alone."""


@dataclass
class _Run:
    """One run's state in its transaction."""

    tx: IngestTransaction
    items: Sequence[Arrived]
    refuse: Refuse
    refused_before: RefusedBefore
    around: Around
    now: datetime | None
    media: list[str | None]
    refused: dict[int, KbError]
    answers: list[CommandAnswer | None]

    @property
    def tenant(self) -> str:
        return self.items[0].command.tenant_id


class RunApplier:
    def __init__(
        self,
        applier: IngestApplier,
        store: IngestStore,
        registry: SchemaRegistry | None = None,
    ) -> None:
        self._applier = applier
        self.single = applier  # one command in its own transaction(s): an erase
        self._store = store
        self._registry = registry or default_registry()

    async def apply_run(
        self,
        items: Sequence[Arrived],
        refuse: Refuse,
        *,
        refusing: Mapping[int, KbError] | None = None,
        refused_before: RefusedBefore = lambda _n, _code: None,
        now: datetime | None = None,
        around: Around = lambda _: contextlib.nullcontext(),
    ) -> list[CommandAnswer | None]:
        """Apply one tenant's ``items`` (no erase among them); the answers in order (None:
        refused now, told to ``refuse``, or before, told to ``refused_before``). ``refusing``:
        commands the caller already refuses (a key revoked since they verified), refused in
        their turn as a refused publish is. A retriable error undoes the whole run: it is
        retried as it was."""
        tenant = items[0].command.tenant_id
        refused: dict[int, KbError] = dict(refusing or {})
        media: list[str | None] = [None] * len(items)
        checked = await self._applier.media_types([item.command for item in items])
        for n, result in enumerate(checked):
            if isinstance(result, KbError):
                refused.setdefault(n, result)
            else:
                media[n] = result
        tier = await self._tier(tenant, items)
        async with self._store.ingest_transaction(tenant) as tx:
            run = _Run(
                tx, items, refuse, refused_before, around, now, media, refused, [None] * len(items)
            )
            await self._apply_in(run, tier)
        for item, answer in zip(items, run.answers, strict=True):
            if isinstance(item.command, DeleteDocument) and answer is not None:
                await self._applier.leftovers(tenant, answer)
        return run.answers

    async def _apply_in(self, run: _Run, tier: str | None) -> None:
        tx, tenant = run.tx, run.tenant
        earlier = await tx.command_answers(tenant, [i.command.command_id for i in run.items])
        sent = await tx.refusals_sent(tenant, [i.source for i in run.items])
        keys = [i.command.document_key for i in run.items if _inline(i.command)]
        mapped = await tx.documents_for_keys(tenant, keys) if keys and tier else {}
        group: list[int] = []
        touched: set[str] = set()  # keys a command of the run worked on, or will
        seen: set[uuid.UUID] = set()
        for n, item in enumerate(run.items):
            command = item.command
            found = earlier.get(command.command_id)
            if found is not None:
                run.answers[n] = dataclasses.replace(found, changed=False)
                continue
            code = sent.get(item.source)
            if code is not None:
                run.refused_before(n, code)  # its dead letter sent when the run ran before
                continue
            key = command.document_key
            fresh = tier is not None and _inline(command) and n not in run.refused
            if (
                fresh
                and key not in mapped
                and key not in touched
                and command.command_id not in seen
            ):
                group.append(n)
                touched.add(key)
                seen.add(command.command_id)
                continue
            if group:
                await self._together(run, group, tier)
                group = []
            touched.add(key)
            seen.add(command.command_id)
            await self._alone(run, n)
        if group:
            await self._together(run, group, tier)

    async def _alone(self, run: _Run, n: int) -> None:
        item = run.items[n]
        if n not in run.refused:
            try:
                with run.around(n):
                    async with run.tx.savepoint():
                        run.answers[n] = await self._applier.applied_in(
                            run.tx, item.command, run.media[n], run.now, item.sent_at
                        )
                return
            except KbError as error:
                if error.retriable:
                    raise
                run.refused[n] = error
        await run.refuse(n, run.refused[n])
        code = run.refused[n].code
        await run.tx.record_refusal(run.tenant, item.source, item.command.command_id, code, run.now)

    async def _together(self, run: _Run, group: list[int], tier: str | None) -> None:
        assert tier is not None
        try:
            async with run.tx.savepoint():
                answers = await self._new_documents(run, group, tier)
        except _OneByOne:
            answers = None
        except KbError as error:
            if error.retriable:
                raise
            answers = None
        if answers is None:
            for n in group:
                await self._alone(run, n)
            return
        for n, answer in zip(group, answers, strict=True):
            run.answers[n] = answer

    async def _new_documents(self, run: _Run, group: list[int], tier: str) -> list[CommandAnswer]:
        tx, tenant = run.tx, run.tenant
        commands = [run.items[n].command for n in group]
        claims = [(run.items[n].command, run.items[n].sent_at) for n in group]
        if await tx.claim_commands(tenant, claims, run.now) != len(group):
            raise _OneByOne  # another process applies one of them now
        documents, events = [], []
        for n, command in zip(group, commands, strict=True):
            assert isinstance(command, PublishDocument)
            assert command.content is not None
            media_type = run.media[n]
            assert media_type is not None
            with run.around(n):
                document = new_published_document(
                    check_title(command.title),
                    command.content,
                    media_type,
                    check_principals(list(command.read_principals)),
                    current_traceparent(),
                )
            documents.append(document)
            events += new_document_events(
                self._registry, tenant, tier, document, run.now, command.command_id
            )
        await tx.bulk().insert_published_documents(tenant, tier, documents, events, run.now)
        pairs = [(c.document_key, d.document_id) for c, d in zip(commands, documents, strict=True)]
        await tx.map_keys(tenant, pairs, run.now)
        answers = [
            CommandAnswer(
                c.command_id,
                c.command_type,
                d.document_id,
                1,
                PUBLISHED_REVISION,
                d.index_task_id,
            )
            for c, d in zip(commands, documents, strict=True)
        ]
        await tx.record_answers(tenant, answers)
        return answers

    async def _tier(self, tenant: str, items: Sequence[Arrived]) -> str | None:
        """The tenant's tier when the run may write new documents together."""
        if not any(_inline(i.command) for i in items):
            return None
        return await self._store.tenant_tier(tenant)


def _inline(command: Command) -> bool:
    """A publish that may create its document (whether its key has one is read after)."""
    return (
        isinstance(command, PublishDocument)
        and command.content is not None
        and command.upload is None
    )

"""One command, applied once: the command id is claimed first in the very transaction that
writes the version, ACL, task and outbox rows (the publisher's own ``*_in`` steps), so the
effect and its record commit together or not at all, and a redelivered command finds its
record and answers what it did, writing nothing (docs/architecture.md#publish-by-event).

No driver here: storage is the ``IngestStore`` port.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from datetime import datetime

from services.publisher.domain import (
    Publisher,
    PublishOutcome,
    RevisionConflict,
    Upload,
    add_version_in,
    check_principals,
    check_title,
    check_upload,
    check_upload_off_loop,
    create_in,
    document_not_found,
)
from services.publisher.ingest.commands import (
    Command,
    CommandInvalid,
    DeleteDocument,
    EraseDocument,
    PublishDocument,
    SetDocumentReaders,
)
from services.publisher.ingest.ports import CommandAnswer, IngestStore, IngestTransaction
from services.publisher.ports import ErasureRequest
from services.runtime.errors import Conflict, KbError, NotFound
from services.runtime.indexing.media_types import run_media_check


class DocumentKeyUnknown(NotFound, code="INGEST_DOCUMENT_KEY_UNKNOWN"):
    """A command for a key no publish has created (yet)."""


class DocumentNotPublished(Conflict, code="DOCUMENT_NOT_PUBLISHED"):
    """Readers set on a document that has no published version."""


class IngestApplier:
    def __init__(self, publisher: Publisher, store: IngestStore, *, max_upload_bytes: int) -> None:
        self._publisher = publisher
        self._store = store
        self._max_upload_bytes = max_upload_bytes

    async def apply(
        self, command: Command, *, now: datetime | None = None, sent_at: datetime | None = None
    ) -> CommandAnswer:
        """Apply ``command`` unless it was applied before; what it did, either way. A
        refusal (a typed error) leaves nothing behind, the command id unrecorded.
        ``sent_at``: when its record reached Kafka, kept with it for the operator page."""
        if isinstance(command, EraseDocument):
            return await self._erase(command, now, sent_at)
        media_type = await self.media_type(command)
        async with self._store.ingest_transaction(command.tenant_id) as tx:
            answer = await self.applied_in(tx, command, media_type, now, sent_at)
        if isinstance(command, DeleteDocument):
            await self.leftovers(command.tenant_id, answer)
        return answer

    async def leftovers(self, tenant_id: str, answer: CommandAnswer) -> None:
        """After the commit, as the single DELETE does: the deleted document's chunks go.
        Also when the answer is an earlier one (a redelivery): a crash between the delete's
        commit and this removal left them, and the redelivery is the chance to finish it.
        The removal's statements read the document's ``deleted_at`` themselves, so on a
        document that is not deleted they change nothing."""
        if answer.document_id is not None:
            await self._publisher.remove_leftovers(tenant_id, answer.document_id)

    async def media_type(self, command: Command) -> str | None:
        upload = _upload(command)
        if upload is None:
            return None
        return await check_upload_off_loop(upload, self._max_upload_bytes)

    async def media_types(self, commands: Sequence[Command]) -> list[str | KbError | None]:
        """Each command's media type (None: no inline content), or the refusal of its
        content; a retriable failure is raised. One trip to the media check's threads for
        the whole run: a trip per command cost the loop more than the checks themselves."""
        uploads = [_upload(command) for command in commands]
        return await run_media_check(_check_each, uploads, self._max_upload_bytes)

    async def applied_in(
        self,
        tx: IngestTransaction,
        command: Command,
        media_type: str | None,
        now: datetime | None,
        sent_at: datetime | None,
    ) -> CommandAnswer:
        earlier = await self._claim(tx, command, now, sent_at)
        if earlier is not None:
            return earlier  # the same command earlier in the run
        answer = await self._apply_in(tx, command, media_type, now)
        await tx.record_answer(command.tenant_id, answer)
        return answer

    async def _claim(
        self,
        tx: IngestTransaction,
        command: Command,
        now: datetime | None,
        sent_at: datetime | None,
    ) -> CommandAnswer | None:
        """None once the command is ours to apply; its earlier answer when it was applied."""
        if await tx.claim_command(command, now, sent_at):
            return None
        earlier = await tx.command_answer(command.tenant_id, command.command_id)
        assert earlier is not None  # claimed by a committed transaction
        return dataclasses.replace(earlier, changed=False)

    async def _apply_in(
        self,
        tx: IngestTransaction,
        command: Command,
        media_type: str | None,
        now: datetime | None,
    ) -> CommandAnswer:
        document_id = await tx.document_for_key(command.tenant_id, command.document_key)
        if isinstance(command, PublishDocument):
            return await self._publish(tx, command, document_id, media_type, now)
        if document_id is None:
            raise DocumentKeyUnknown(
                f"no document has the key {command.document_key[:80]!r} in this tenant"
            )
        if isinstance(command, SetDocumentReaders):
            return await self._set_readers(tx, command, document_id, now)
        assert isinstance(command, DeleteDocument)
        revision, _, _ = await self._publisher.delete_in(
            tx, command.tenant_id, document_id, command.expected_revision, now, command.command_id
        )
        return _answer(command, document_id, revision=revision)

    async def _publish(
        self,
        tx: IngestTransaction,
        command: PublishDocument,
        document_id: uuid.UUID | None,
        media_type: str | None,
        now: datetime | None,
    ) -> CommandAnswer:
        tenant = command.tenant_id
        principals = check_principals(list(command.read_principals))
        expected = command.expected_revision
        if document_id is not None and await _deleted(tx, tenant, document_id):
            # The producer's document came back after its delete (a page restored, a ticket
            # reopened): a deleted document takes no version, so the key gets a new one.
            await tx.forget_key(tenant, command.document_key)
            document_id = None
        if command.upload is not None:
            version = command.upload.version_number
            if document_id is None:
                document_id = command.upload.document_id
                if await tx.lock_document(tenant, document_id) is None:
                    raise document_not_found(document_id)
                await tx.map_key(tenant, command.document_key, document_id, now)
            elif document_id != command.upload.document_id:
                raise CommandInvalid(
                    f"the upload is of document {command.upload.document_id}, but the key "
                    f"{command.document_key[:80]!r} is document {document_id}"
                )
        else:
            assert command.content is not None
            assert media_type is not None
            if document_id is None:
                document_id = uuid.uuid4()
                created = await create_in(
                    tx,
                    tenant,
                    document_id,
                    check_title(command.title),
                    command.content,
                    media_type,
                    now,
                )
                await tx.map_key(tenant, command.document_key, document_id, now)
            else:
                await _check_revision(tx, tenant, document_id, expected)
                created = await add_version_in(
                    tx, tenant, document_id, command.content, media_type, now
                )
            version, expected = created.version_number, created.revision
        outcome = await self._publisher.publish_in(
            tx, tenant, document_id, version, expected, principals, now, command.command_id
        )
        return _published(command, outcome)

    async def _set_readers(
        self,
        tx: IngestTransaction,
        command: SetDocumentReaders,
        document_id: uuid.UUID,
        now: datetime | None,
    ) -> CommandAnswer:
        principals = check_principals(list(command.read_principals))
        document = await tx.lock_document(command.tenant_id, document_id)
        if document is None:
            raise document_not_found(document_id)
        if document.published_version is None:
            raise DocumentNotPublished(f"document {document_id} has no published version")
        outcome = await self._publisher.publish_in(
            tx,
            command.tenant_id,
            document_id,
            document.published_version,
            command.expected_revision,
            principals,
            now,
            command.command_id,
        )
        return _published(command, outcome)

    async def _erase(
        self, command: EraseDocument, now: datetime | None, sent_at: datetime | None
    ) -> CommandAnswer:
        """An erase runs in batches of their own transactions, never in one: it is
        idempotent itself (an erased document answers what its erase did, one left halfway
        is finished), so it runs first and the command is recorded after it; a redelivery
        before the record runs it again, which writes nothing more. The producer's key may
        be personal data: the record's transaction removes it, so a redelivery after the
        record finds the record first, not the key."""
        tenant = command.tenant_id
        async with self._store.ingest_transaction(tenant) as tx:
            earlier = await tx.command_answer(tenant, command.command_id)
            if earlier is not None:
                return dataclasses.replace(earlier, changed=False)
            document_id = await tx.document_for_key(tenant, command.document_key)
        if document_id is None:
            raise DocumentKeyUnknown(
                f"no document has the key {command.document_key[:80]!r} in this tenant"
            )
        await self._publisher.erase_document(
            tenant,
            document_id,
            ErasureRequest(requested_by="ingest"),
            now=now,
            command_id=command.command_id,
        )
        answer = _answer(command, document_id)
        async with self._store.ingest_transaction(tenant) as tx:
            earlier = await self._claim(tx, command, now, sent_at)
            if earlier is not None:
                return earlier
            await tx.record_answer(tenant, answer)
            await tx.forget_document_key(tenant, document_id)
        return answer


async def _deleted(tx: IngestTransaction, tenant_id: str, document_id: uuid.UUID) -> bool:
    document = await tx.lock_document(tenant_id, document_id)
    return document is not None and document.deleted_at is not None


async def _check_revision(
    tx: IngestTransaction, tenant_id: str, document_id: uuid.UUID, expected: int | None
) -> None:
    document = await tx.lock_document(tenant_id, document_id)
    if document is None:
        raise document_not_found(document_id)
    if expected is not None and expected != document.revision:
        raise RevisionConflict(expected, document.revision)


def _published(command: Command, outcome: PublishOutcome) -> CommandAnswer:
    return _answer(
        command,
        outcome.document_id,
        version_number=outcome.version_number,
        revision=outcome.revision,
        task_id=outcome.index_task_id,
    )


def _answer(
    command: Command,
    document_id: uuid.UUID,
    *,
    version_number: int | None = None,
    revision: int | None = None,
    task_id: uuid.UUID | None = None,
) -> CommandAnswer:
    return CommandAnswer(
        command.command_id, command.command_type, document_id, version_number, revision, task_id
    )


def _upload(command: Command) -> Upload | None:
    if isinstance(command, PublishDocument) and command.content is not None:
        return Upload(command.content, command.media_type, command.filename)
    return None


def _check_each(uploads: list[Upload | None], max_upload_bytes: int) -> list[str | KbError | None]:
    checked: list[str | KbError | None] = []
    for upload in uploads:
        try:
            checked.append(None if upload is None else check_upload(upload, max_upload_bytes))
        except KbError as error:
            if error.retriable:
                raise
            checked.append(error)
    return checked

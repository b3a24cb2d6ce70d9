"""The checker: once the system has settled, every invariant is checked against the
database, the Kafka topics and the searcher's answers. A violation is named with its
evidence; the run fails on any."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition

from kbtools.chaos.checks.answers import ChunkSets, check_answers, documents_of
from kbtools.chaos.checks.commands import check_commands
from kbtools.chaos.checks.converge import check_pointers
from kbtools.chaos.checks.dead_letters import DeadLetter, check_poisons, dead_letter
from kbtools.chaos.checks.logs import lease_figures, search_reads
from kbtools.chaos.checks.queries import QUERIES
from kbtools.chaos.checks.removals import (
    check_dump,
    check_final,
    check_kafka,
    check_removed_answers,
    gone_documents,
    pg_dump,
    removal_figures,
    scan_dump,
)
from kbtools.chaos.checks.result import KEEP, CheckResult
from kbtools.chaos.rig.topology import TIERS, ChaosStack
from kbtools.chaos.traffic.load import LoadRecord
from kbtools.chaos.traffic.searcher import SearchRecord
from kbtools.devstack.postgres import pginstall_dir
from services.runtime.messaging.avro import default_registry
from services.runtime.messaging.events import (
    DOCUMENT_SEARCH_VERSION_SWITCHED,
    INDEX_TASK_CREATED,
    document_events_topic,
    index_hints_topic,
    ingest_dead_topic,
)

PROVIDER_CODES = (
    "EMBEDDING_RATE_LIMITED",
    "EMBEDDING_TIMEOUT",
    "EMBEDDING_UNAVAILABLE",
    "EMBEDDING_RESPONSE_MALFORMED",
)


@dataclass
class KafkaRecord:
    topic: str
    key: str
    event_id: str
    event_type: str
    position: int
    replay: bool
    payload: bytes


async def read_topics(stack: ChaosStack) -> list[KafkaRecord]:
    """Every record of the run's topics, from the beginning to their current end."""
    topics = [document_events_topic(stack.topic_prefix)] + [
        index_hints_topic(tier, stack.topic_prefix) for tier in TIERS
    ]
    records = []
    for topic, message in await read_messages(stack, topics):
        headers = {k: v.decode() for k, v in message.headers}
        records.append(
            KafkaRecord(
                topic,
                (message.key or b"").decode(),
                headers.get("event_id", ""),
                headers.get("event_type", ""),
                int(headers.get("outbox_position", "0")),
                headers.get("replay") == "true",
                message.value or b"",
            )
        )
    return records


async def read_dead_letters(stack: ChaosStack) -> list[DeadLetter]:
    """Every record of the tiers' ingest dead-letter topics."""
    topics = [ingest_dead_topic(tier, stack.topic_prefix) for tier in TIERS]
    return [dead_letter(topic, m.headers) for topic, m in await read_messages(stack, topics)]


async def read_messages(stack: ChaosStack, topics: list[str]) -> list[tuple[str, Any]]:
    """Every message of ``topics`` (those that exist), from the beginning to their end."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=stack.kafka.bootstrap, enable_auto_commit=False, group_id=None
    )
    await consumer.start()
    messages: list[tuple[str, Any]] = []
    try:
        partitions = [
            TopicPartition(topic, p)
            for topic in topics
            for p in sorted(
                consumer.partitions_for_topic(topic) or await _partitions(consumer, topic)
            )
        ]
        if not partitions:
            return messages
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        pending = {tp for tp in partitions if ends[tp] > 0}
        while pending:
            batch = await consumer.getmany(timeout_ms=2000)
            for tp, batch_messages in batch.items():
                messages.extend((tp.topic, m) for m in batch_messages)
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
    finally:
        await consumer.stop()
    return messages


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    await consumer._client.force_metadata_update()
    return consumer.partitions_for_topic(topic) or set()


class Checker:
    def __init__(
        self, stack: ChaosStack, searches: SearchRecord, load: LoadRecord | None = None
    ) -> None:
        self.stack = stack
        self.searches = searches
        self.load = load or LoadRecord()
        self.gone = gone_documents(self.load.removed)
        self.result = CheckResult()

    async def check(self) -> CheckResult:
        # The operator's own check runs as a process beside the reads below.
        index_check = asyncio.create_task(asyncio.to_thread(self.stack.kb_status, "index", "check"))
        conn = await asyncpg.connect(self.stack.database_url)
        try:
            records = await self._outbox_in_kafka(conn)
            await self._tasks(conn)
            await check_pointers(conn, self.result)
            await self._chunks(conn)
            self._pointer_forward(records)
            await self._stale_leases(conn, records)
            await self._answers(conn)
            self._reads_from_log()
            await self._removals(conn, records)
            commands = [dict(r.items()) for r in await conn.fetch(QUERIES["ingest_commands"])]
            check_commands(
                self.load.commands,
                commands,
                [dict(r.items()) for r in await conn.fetch(QUERIES["ingest_versions"])],
                self.result,
            )
            applied = {(r["tenant_id"], r["command_id"]) for r in commands}
            check_poisons(
                self.load.poisons,
                await read_dead_letters(self.stack),
                lambda tenant_id, command_id: (tenant_id, command_id) in applied,
                self.result,
            )
        finally:
            await conn.close()
        status, output = await index_check
        if status != 0:
            for line in output.strip().splitlines()[:KEEP]:
                self.result.violate("kb index check clean", line[:300])
        return self.result

    async def _outbox_in_kafka(self, conn: asyncpg.Connection[Any]) -> list[KafkaRecord]:
        """Every committed outbox row in Kafka, each document's events first seen in the
        order of their outbox positions. Waits a little for relays still catching up."""
        rows = await conn.fetch(QUERIES["outbox_events"])
        committed = {row["event_id"]: row for row in rows}
        deadline = time.monotonic() + 60
        while True:
            records = await read_topics(self.stack)
            seen = {r.event_id for r in records}
            missing = set(committed) - seen
            if not missing or time.monotonic() > deadline:
                break
            await asyncio.sleep(2)
        invariant = "outbox events all in Kafka, in order"
        for event_id in sorted(missing):
            self.result.violate(invariant, f"event {event_id} never reached Kafka")
        # Kafka orders one key within one topic: a document's hints (its tier's topic) and
        # its lifecycle events (the document-events topic) are ordered each on their own.
        first_seen: dict[tuple[str, str], list[int]] = defaultdict(list)
        met: set[str] = set()
        for record in records:
            if record.replay or record.event_id in met:
                continue
            met.add(record.event_id)
            first_seen[(record.topic, record.key)].append(record.position)
        for (topic, key), positions in first_seen.items():
            if positions != sorted(positions):
                self.result.violate(
                    invariant, f"{key} in {topic}: outbox positions {positions} out of order"
                )
        hints = [r for r in records if r.event_type == INDEX_TASK_CREATED and not r.replay]
        self.result.figures["outbox events"] = len(committed)
        self.result.figures["kafka records"] = len(records)
        self.result.figures["duplicate hints"] = len(hints) - len({r.event_id for r in hints})
        self.result.figures["replayed records"] = sum(r.replay for r in records)
        return records

    async def _tasks(self, conn: asyncpg.Connection[Any]) -> None:
        rows = await conn.fetch(QUERIES["tasks"])
        figures = self.result.figures
        figures["tasks"] = len(rows)
        figures["tasks succeeded"] = sum(r["status"] == "SUCCEEDED" for r in rows)
        figures["tasks dead"] = sum(r["status"] == "DEAD" for r in rows)
        figures["retries"] = sum(max(0, r["attempts"] - 1) for r in rows)
        codes: dict[str, int] = defaultdict(int)
        for row in rows:
            version = f"{row['tenant_id']}/{row['document_id']} v{row['version_number']}"
            where = f"task {row['task_id']} ({version})"
            if row["status"] not in ("SUCCEEDED", "DEAD"):
                self.result.violate("tasks settled", f"{where} still {row['status']}")
            if row["status"] == "DEAD":
                codes[row["error_code"] or "none"] += 1
                if row["error_code"] is None:
                    self.result.violate("tasks settled", f"{where} DEAD without a code")
                elif row["error_code"] in PROVIDER_CODES:
                    self.result.violate(
                        "no DEAD for a provider fault", f"{where} DEAD {row['error_code']}"
                    )
        figures["dead codes"] = dict(codes)

    async def _chunks(self, conn: asyncpg.Connection[Any]) -> None:
        invariant = "one chunk set per served version"
        duplicates = await conn.fetch(QUERIES["duplicate_chunks"])
        for row in duplicates:
            self.result.violate(
                invariant,
                f"{row['tenant_id']}/{row['document_id']} v{row['version_number']} ordinal "
                f"{row['ordinal']}: {row['count']} chunks",
            )
        mismatched = await conn.fetch(QUERIES["served_chunk_counts"])
        for row in mismatched:
            if row["chunk_count"] is not None and row["chunk_count"] != row["stored"]:
                self.result.violate(
                    invariant,
                    f"{row['tenant_id']}/{row['document_id']} v{row['version_number']}: "
                    f"{row['stored']} chunks stored, {row['chunk_count']} switched to",
                )

    def _pointer_forward(self, records: list[KafkaRecord]) -> None:
        """Audited from the DocumentSearchVersionSwitched events, in Kafka's per-key order."""
        registry = default_registry()
        last: dict[tuple[str, str], int] = {}
        met: set[str] = set()
        switches = 0
        for record in records:
            if record.event_type != DOCUMENT_SEARCH_VERSION_SWITCHED or record.replay:
                continue
            if record.event_id in met:
                continue
            met.add(record.event_id)
            switches += 1
            event = registry.decode(record.payload).record
            key = (record.key, str(event["embeddingModel"]))
            version = int(event["versionNumber"])
            if key in last and version < last[key]:
                self.result.violate(
                    "pointer only moves forward",
                    f"{record.key} ({key[1]}): switched back from v{last[key]} to v{version}",
                )
            last[key] = max(version, last.get(key, 0))
        self.result.figures["switches"] = switches

    async def _stale_leases(
        self, conn: asyncpg.Connection[Any], records: list[KafkaRecord]
    ) -> None:
        """Every switch (served now, or announced in Kafka) was made by a task that
        succeeded for that very version: a write under a lost lease would name an attempt
        that did not finish, or another version's task."""
        invariant = "no write by a stale lease"
        tasks = {str(r["task_id"]): r for r in await conn.fetch(QUERIES["task_versions"])}
        served = await conn.fetch(QUERIES["served_tasks"])
        for row in served:
            task = tasks.get(row["task_id"] or "")
            if (
                task is None
                or task["status"] != "SUCCEEDED"
                or (task["version_number"] != row["version_number"])
            ):
                self.result.violate(
                    invariant,
                    f"{row['tenant_id']}/{row['document_id']} v{row['version_number']} "
                    f"served by task {row['task_id']} ({task['status'] if task else 'unknown'})",
                )
        registry = default_registry()
        for record in records:
            if record.event_type != DOCUMENT_SEARCH_VERSION_SWITCHED:
                continue
            event = registry.decode(record.payload).record
            task = tasks.get(str(event["taskId"]))
            if task is None or task["status"] != "SUCCEEDED":
                self.result.violate(
                    invariant,
                    f"switch to v{event['versionNumber']} of {record.key} by task "
                    f"{event['taskId']} ({task['status'] if task else 'unknown'})",
                )
        self._leases_from_logs()

    def _reads_from_log(self) -> None:
        replica, primary = search_reads(self.stack.processes.home / "api.log")
        self.result.figures["searches read from the replica"] = replica
        self.result.figures["searches read from the primary"] = primary

    def _leases_from_logs(self) -> None:
        lost, takeovers = lease_figures(self.stack.processes.home.glob("indexer-*.log"))
        self.result.figures["lost leases"] = lost
        self.result.figures["takeovers"] = takeovers

    async def _removals(self, conn: asyncpg.Connection[Any], records: list[KafkaRecord]) -> None:
        """The deletes and erases the load did (kbtools/chaos/checks/removals.py)."""
        removal_figures(self.load.removed, self.result)
        check_removed_answers(self.searches.answers, self.gone, self.result)
        await check_final(conn, self.gone, self.load.unanswered, records, self.result)
        erased: dict[str, str] = {}
        kept: set[str] = set()
        for p in self.load.published:
            if not p.marker:
                continue
            gone = self.gone.get(p.document_id)
            if gone is not None and gone.erased:
                erased[p.marker] = f"{p.tenant_id}/{p.document_id} v{p.version_number}"
            else:
                kept.add(p.marker)
        check_kafka(records, erased, self.result)
        dump = self.stack.processes.home / "pg_dump.sql"
        try:
            await asyncio.to_thread(
                pg_dump, pginstall_dir() / "bin" / "pg_dump", self.stack.database_url, dump
            )
            check_dump(await asyncio.to_thread(scan_dump, dump), erased, kept, self.result)
        finally:
            dump.unlink(missing_ok=True)

    def _readers(self) -> dict[tuple[str, int], set[str]]:
        """The readers each version was published with, as the load driver recorded them:
        an erase removes the versions' ACL rows, not what its searches saw before."""
        return {
            (p.document_id, p.version_number): set(p.readers)
            for p in self.load.published
            if p.document_id in self.gone and self.gone[p.document_id].erased
        }

    async def _answers(self, conn: asyncpg.Connection[Any]) -> None:
        owners = {
            str(r["document_id"]): r["tenant_id"]
            for r in await conn.fetch(QUERIES["document_owners"])
        }
        acl: dict[tuple[str, int], set[str]] = defaultdict(set, self._readers())
        for row in await conn.fetch(QUERIES["version_readers"]):
            acl[(row["document_id"], row["version_number"])].add(row["principal"])
        whole = "search: one whole version per document"
        fenced = "search: within ACL and tenant"
        answered = 0
        for answer in self.searches.answers:
            if answer.tenant_id != answer.path_tenant:
                if answer.status == 200:
                    self.result.violate(
                        fenced, f"{answer.tenant_id}'s key searched {answer.path_tenant}: 200"
                    )
                continue
            if answer.status != 200:
                continue
            answered += 1
            versions: dict[str, set[int]] = defaultdict(set)
            for hit in answer.hits:
                versions[hit.document_id].add(hit.version_number)
                owner = owners.get(hit.document_id)
                if owner != answer.path_tenant:
                    self.result.violate(
                        fenced, f"{answer.path_tenant} got {hit.document_id} of {owner}"
                    )
                readers = acl.get((hit.document_id, hit.version_number), set())
                if not readers & set(answer.principals):
                    self.result.violate(
                        fenced,
                        f"{list(answer.principals)} got {hit.document_id} v{hit.version_number}"
                        f" readable by {sorted(readers)}",
                    )
            for document_id, seen in versions.items():
                if len(seen) > 1:
                    self.result.violate(whole, f"{document_id}: versions {sorted(seen)} at once")
        check_answers(self.searches.answers, await self._chunk_sets(conn), self.result)
        figures = self.result.figures
        figures["searches"] = len(self.searches.answers)
        figures["searches answered"] = answered
        figures["searches without answer"] = self.searches.failed

    async def _chunk_sets(self, conn: asyncpg.Connection[Any]) -> ChunkSets:
        """The chunk sets of every version of the documents the answers hold."""
        sets = ChunkSets()
        for row in await conn.fetch(QUERIES["generation_models"]):
            sets.models[row["generation_id"]] = row["embedding_model"]
            if row["is_default"]:
                sets.models[None] = row["embedding_model"]
        rows = await conn.fetch(QUERIES["answered_chunks"], documents_of(self.searches.answers))
        for row in rows:
            sets.add(
                row["document_id"],
                row["version_number"],
                row["embedding_model"],
                row["chunk_id"],
                row["md5"],
            )
        return sets

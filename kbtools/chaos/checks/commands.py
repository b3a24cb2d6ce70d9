"""The check that every command a chaos run sent by event was applied exactly once
(kbtools/chaos/traffic/ingest.py sends them; docs/architecture.md#publish-by-event)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kbtools.chaos.checks.result import INGEST_ONCE, CheckResult
from kbtools.chaos.traffic.ingest import SentCommand
from services.publisher.ingest.commands import PUBLISH_DOCUMENT


def check_commands(
    sent: Sequence[SentCommand],
    rows: Iterable[Mapping[str, Any]],
    versions: Iterable[Mapping[str, Any]],
    result: CheckResult,
) -> None:
    """Every command sent applied exactly once: one record per command id, none missing,
    and each version of a document published by command made by exactly one of them (a
    version no record names is a command applied twice, or without its record)."""
    rows = list(rows)
    records = Counter((r["tenant_id"], r["command_id"]) for r in rows)
    for command in sent:
        where = f"command {command.tenant_id}/{command.command_id} ({command.document_key})"
        count = records[(command.tenant_id, command.command_id)]
        if count == 0:
            result.violate(INGEST_ONCE, f"{where} sent, never applied")
        elif count > 1:
            result.violate(INGEST_ONCE, f"{where} recorded {count} times")
    made: dict[tuple[str, str, int], list[str]] = defaultdict(list)
    for row in rows:
        if row["command_type"] != PUBLISH_DOCUMENT:
            continue
        if row["version_number"] is None:
            result.violate(INGEST_ONCE, f"publish {row['command_id']} recorded without a version")
            continue
        made[(row["tenant_id"], row["document_id"], row["version_number"])].append(
            row["command_id"]
        )
    for version in versions:
        at = (version["tenant_id"], version["document_id"], version["version_number"])
        by = made.get(at, [])
        if len(by) != 1:
            result.violate(
                INGEST_ONCE,
                f"{at[0]}/{at[1]} v{at[2]} made by {len(by)} commands {sorted(by)}",
            )
    result.figures["ingest commands sent"] = len(sent)
    result.figures["ingest commands applied"] = sum(
        1 for c in sent if records[(c.tenant_id, c.command_id)]
    )
    result.figures["ingest commands"] = dict(sorted(Counter(c.command_type for c in sent).items()))

"""The checks of each search answer against the chunk sets the run left in the database.

A version's chunk set, in one generation (its embedding model), is written whole by the
completion that switches to it and never changes after (a re-run writes the same ids, the
re-run check proves it), so the database after the run is the reference for every answer
given during it. A set the collector of superseded chunks deleted since cannot be checked:
such hits are counted, not judged. The second generation of a run chunks with other
settings, so a chunk id names its generation (the id hashes the chunking strategy).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from kbtools.chaos.checks.result import (
    HIT_IN_ITS_VERSION,
    ONE_GENERATION,
    READ_YOUR_SWITCH,
    CheckResult,
)
from kbtools.chaos.traffic.searcher import Answer


def text_digest(text: str) -> str:
    """md5 of the text, as PostgreSQL's md5(text) gives it (UTF-8)."""
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


@dataclass
class ChunkSets:
    """Of each (document, version): each generation's chunk set, by embedding model, as
    chunk id -> md5 of its text; and the model of each generation id (None: the default)."""

    versions: dict[tuple[str, int], dict[str, dict[str, str]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    models: dict[int | None, str] = field(default_factory=dict)

    def add(self, document_id: str, version: int, model: str, chunk_id: str, md5: str) -> None:
        self.versions[(document_id, version)].setdefault(model, {})[chunk_id] = md5


def check_answers(answers: Iterable[Answer], sets: ChunkSets, result: CheckResult) -> None:
    """Each hit of an answer is a chunk (id and text) of its version in the generation that
    answered; no answer holds another generation's chunk; an answer that passed a status's
    token shows that document at the status's version or later. One violation per answer
    and invariant (the first hit at fault as its evidence)."""
    checked = collected = promised = promised_found = 0
    for answer in answers:
        if answer.status != 200 or answer.tenant_id != answer.path_tenant:
            continue
        model = sets.models.get(answer.generation_id)
        half: str | None = None
        mixed: str | None = None
        for hit in answer.hits:
            where = f"{hit.document_id} v{hit.version_number} chunk {hit.chunk_id}"
            generations = sets.versions.get((hit.document_id, hit.version_number), {})
            holding = sorted(m for m, ids in generations.items() if hit.chunk_id in ids)
            own = generations.get(model) if model is not None else None
            if own is None or hit.chunk_id not in own:
                if holding:
                    mixed = mixed or (
                        f"{where} is of {', '.join(holding)}, in an answer served by "
                        f"generation {answer.generation_id} ({model})"
                    )
                elif own is None:
                    collected += 1  # that set is gone (collected): nothing to judge by
                else:
                    half = half or (
                        f"{where}: not one of the {len(own)} chunks of the version ({model})"
                    )
                continue
            checked += 1
            if own[hit.chunk_id] != text_digest(hit.text):
                half = half or f"{where}: another text than the version's chunk ({model})"
        if half is not None:
            result.violate(HIT_IN_ITS_VERSION, half)
        if mixed is not None:
            result.violate(ONE_GENERATION, mixed)
        if answer.promise is not None:
            promised += 1
            wanted = answer.promise
            seen = sorted(
                {h.version_number for h in answer.hits if h.document_id == wanted.document_id}
            )
            promised_found += bool(seen)
            if seen and seen[0] < wanted.version_number:
                result.violate(
                    READ_YOUR_SWITCH,
                    f"{wanted.document_id}: status said v{wanted.version_number}, the search "
                    f"passing its token answered v{seen[0]}",
                )
    figures = result.figures
    figures["hits checked against their version"] = checked
    figures["hits of collected versions"] = collected
    figures["searches with a token"] = promised
    figures["searches with a token that found their document"] = promised_found


def documents_of(answers: Iterable[Answer]) -> list[str]:
    """The documents the answers hold, whose chunk sets the check needs."""
    return sorted({hit.document_id for answer in answers for hit in answer.hits})

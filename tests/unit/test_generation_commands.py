"""What `kb index generations` checks before it touches the database, and how it counts."""

from __future__ import annotations

import uuid

import pytest

from services.indexer.generations.model import (
    GenerationSpec,
    MissingDocument,
    Progress,
    SwitchRefused,
    human_bytes,
    tenant_ids,
)
from services.runtime.commands.cli_support import EXIT_BAD_INPUT, exit_code
from services.runtime.errors import BadInput


def test_a_well_formed_spec_is_its_candidate_generation() -> None:
    spec = GenerationSpec("hosted", "text-embedding-3-small", 1536, 256, 32)
    candidate = spec.candidate()
    assert (candidate.provider_profile, candidate.embedding_model, candidate.dimension) == (
        "hosted",
        "text-embedding-3-small",
        1536,
    )
    assert (candidate.chunk_max_tokens, candidate.chunk_overlap_tokens) == (256, 32)
    assert candidate.active
    assert not candidate.is_default


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("Hosted", "m", 8, 256, 0), "--provider 'Hosted'"),
        (("hosted", "bad model!", 8, 256, 0), "--model"),
        (("hosted", "m", 0, 256, 0), "--dimensions 0"),
        (("hosted", "m", 16001, 256, 0), "--dimensions 16001"),
        (("hosted", "m", 8, 15, 0), "--chunk-tokens 15"),
        (("hosted", "m", 8, 256, 128), "--chunk-overlap 128"),
        (("hosted", "m", 8, 256, -1), "--chunk-overlap -1"),
    ],
)
def test_a_malformed_spec_is_bad_input(args: tuple[str, str, int, int, int], message: str) -> None:
    with pytest.raises(BadInput, match=message) as refused:
        GenerationSpec(*args)
    assert exit_code(refused.value) == EXIT_BAD_INPUT


def test_tenant_ids_are_checked_and_deduplicated() -> None:
    assert tenant_ids(["acme", "beta", "acme"]) == ["acme", "beta"]
    with pytest.raises(BadInput, match="tenant 'Acme'"):
        tenant_ids(["acme", "Acme"])


def test_progress_counts_done_out_of_everything_to_do() -> None:
    assert Progress(done=1, pending=1, failed=2, chunks=9).percent == 25.0
    assert Progress(done=0, pending=0, failed=0, chunks=0).percent == 100.0
    assert Progress(done=3, pending=0, failed=0, chunks=0).total == 3


def test_a_refused_switch_is_bad_input_naming_the_count() -> None:
    missing = [MissingDocument(uuid.UUID(int=1), 3, None), MissingDocument(uuid.UUID(int=2), 3, 2)]
    refused = SwitchRefused("acme", 7, missing, 40)
    assert exit_code(refused) == EXIT_BAD_INPUT
    assert refused.code == "GENERATION_INCOMPLETE"
    assert "40 documents" in refused.message
    assert missing[0].line().endswith("served v3  built none")
    assert missing[1].line().endswith("served v3  built v2")


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 2048, 5 * 1024**3, 3 * 1024**4)] == [
        "0 B",
        "1023 B",
        "2.0 kB",
        "5.0 GB",
        "3072.0 GB",
    ]

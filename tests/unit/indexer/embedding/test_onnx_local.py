"""The real local model: these tests run the shipped int8 all-MiniLM-L6-v2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.embedding import Embedder
from services.embedding.onnx_local import (
    MODEL_NAME,
    ModelFileRejected,
    OnnxLocalEmbedder,
    default_model_file,
)
from services.embedding.tokens import load_token_counter


@pytest.fixture(scope="module")
def embedder() -> OnnxLocalEmbedder:
    return OnnxLocalEmbedder(intra_op_threads=1, inference_batch_size=4)


async def test_rows_are_unit_vectors_of_384_dimensions(embedder: OnnxLocalEmbedder) -> None:
    vectors = await embedder.embed(["refund policy", "", "The server room is on the third floor"])
    assert vectors.shape == (3, 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


async def test_a_paraphrase_is_closer_than_an_unrelated_sentence(
    embedder: OnnxLocalEmbedder,
) -> None:
    question, answer, unrelated = await embedder.embed(
        [
            "How long do customers have to return an item?",
            "Items can be returned within 30 days",
            "The server room is on the third floor",
        ]
    )
    assert float(question @ answer) > float(question @ unrelated) + 0.3


async def test_a_text_alone_equals_the_same_text_padded_inside_a_batch(
    embedder: OnnxLocalEmbedder,
) -> None:
    text = "Items can be returned within 30 days"
    (alone,) = await embedder.embed([text])
    # Longer and shorter neighbours in the same sub-batch pad `text` on the right; with
    # inference_batch_size=4 the shortest four share one sub-batch.
    batch = ["ok", "a much longer sentence about shipping " * 6, text, "x", "tail " * 300]
    together = await embedder.embed(batch)
    np.testing.assert_allclose(together[2], alone, atol=1e-5)
    (long_alone,) = await embedder.embed([batch[4]])
    np.testing.assert_allclose(together[4], long_alone, atol=1e-5)


async def test_inputs_past_256_tokens_are_truncated(embedder: OnnxLocalEmbedder) -> None:
    count = load_token_counter(embedder.tokenizer)
    head = "alpha beta gamma delta " * 80
    assert count(head) > 256
    first, second = await embedder.embed([head, head + "completely different ending " * 20])
    np.testing.assert_allclose(first, second, atol=1e-5)


def test_identity_for_the_index_and_for_chunking(embedder: OnnxLocalEmbedder) -> None:
    assert isinstance(embedder, Embedder)
    assert embedder.model == MODEL_NAME == "all-MiniLM-L6-v2-onnx-int8"
    assert embedder.dimension == 384
    assert embedder.tokenizer.max_input_tokens == 256
    assert embedder.tokenizer.tokenizer_file is not None
    assert Path(embedder.tokenizer.tokenizer_file).is_file()
    # the tokenizer file's baked-in 128-token padding must not leak into counting
    assert load_token_counter(embedder.tokenizer)("refund") < 5


async def test_a_model_file_with_another_sha256_is_refused(tmp_path: Path) -> None:
    tampered = tmp_path / "model.onnx"
    original = default_model_file().read_bytes()
    tampered.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(ModelFileRejected, match="sha256") as caught:
        await OnnxLocalEmbedder(model_file=tampered).warm_up()
    assert caught.value.code == "EMBEDDING_MODEL_FILE_INVALID"
    with pytest.raises(ModelFileRejected):
        await OnnxLocalEmbedder(model_file=tampered).embed(["text"])


async def test_a_missing_model_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelFileRejected, match="unreadable"):
        await OnnxLocalEmbedder(model_file=tmp_path / "absent.onnx").warm_up()


async def test_concurrent_requests_share_the_session_and_get_their_own_rows() -> None:
    import asyncio

    embedder = OnnxLocalEmbedder(intra_op_threads=1, max_concurrent_inferences=2)
    texts = [f"question {i} about the refund window" for i in range(6)]
    alone = await embedder.embed(texts)
    together = await asyncio.gather(*(embedder.embed([text]) for text in texts))
    np.testing.assert_allclose(np.vstack(together), alone, atol=1e-5)


async def test_the_vectors_are_the_same_whatever_the_runs_the_split_and_the_order() -> None:
    import random

    texts = [
        "tail " * 300,
        "ok",
        "Items can be returned within 30 days",
        "a much longer sentence about shipping and returns " * 5,
        "x",
        "refund policy",
        "the warehouse ships on weekdays " * 12,
    ]
    # One run of two threads, the former default: each text alone.
    former = OnnxLocalEmbedder(intra_op_threads=2, runs_per_request=1)
    alone = np.vstack([await former.embed([text]) for text in texts])
    shuffled = list(range(len(texts)))
    random.Random(3).shuffle(shuffled)
    for runs, sub_batch in ((1, 1), (2, 1), (3, 2), (4, 1), (2, 3)):
        embedder = OnnxLocalEmbedder(runs_per_request=runs, inference_batch_size=sub_batch)
        assert embedder.plan.runs_per_request == runs
        np.testing.assert_allclose(await embedder.embed(texts), alone, atol=1e-5)
        reordered = await embedder.embed([texts[i] for i in shuffled])
        np.testing.assert_allclose(reordered, alone[shuffled], atol=1e-5)
        await embedder.aclose()


async def test_warm_up_logs_the_plan_it_chose(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from structlog.testing import capture_logs

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    # No CPU quota: the cores are the affinity, whatever cgroup runs the tests.
    monkeypatch.setattr("services.runtime.cpus.CGROUP_ROOT", tmp_path)
    embedder = OnnxLocalEmbedder()
    with capture_logs() as logs:
        await embedder.warm_up()
    (loaded,) = [line for line in logs if line["event"] == "embedding.model_loaded"]
    assert loaded["usable_cores"] == 3
    assert loaded["cpu_quota"] is None
    assert (loaded["intra_op_threads"], loaded["runs_per_request"]) == (1, 3)
    assert loaded["max_concurrent_inferences"] == 1


async def test_warm_up_logs_the_cpu_quota_that_capped_the_cores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from structlog.testing import capture_logs

    # A pod limited to 1.5 CPUs on a 16-core node: the quota, not the affinity, sized it.
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/\n")
    (tmp_path / "sys" / "fs" / "cgroup").mkdir(parents=True)
    (tmp_path / "sys" / "fs" / "cgroup" / "cpu.max").write_text("150000 100000\n")
    monkeypatch.setattr("services.runtime.cpus.CGROUP_ROOT", tmp_path)
    embedder = OnnxLocalEmbedder()
    with capture_logs() as logs:
        await embedder.warm_up()
    (loaded,) = [line for line in logs if line["event"] == "embedding.model_loaded"]
    assert (loaded["cpu_quota"], loaded["usable_cores"]) == (2, 2)
    assert loaded["runs_per_request"] == 2

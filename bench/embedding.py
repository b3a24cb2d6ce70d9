"""Throughput of the local embedding model: the bare onnxruntime loop vs our provider, same run.

    uv run python -m bench.embedding --threads 1 2 --texts 256

The bare loop is what any caller of the model would write: tokenize a batch padded to its
longest input (truncated at 256 tokens), one ``session.run``, mean pooling, L2 norm. Our
provider (``OnnxLocalEmbedder``) adds the sha256 check at load, sorting by length into
sub-batches and the hop into a thread; it is measured through ``embed_batched`` exactly as
the pipeline calls it. Three text sets: short paragraphs (~40 tokens), full chunks (~250
tokens) and a realistic mix (20..256 tokens, where sorting matters). Reported: texts/s
(median of --repeat runs) and ours / bare. Not part of the test suite; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import onnxruntime
from tokenizers import Tokenizer

from services.embedding.batching import embed_batched
from services.embedding.onnx_local import (
    MAX_SEQ_LENGTH,
    OnnxLocalEmbedder,
    default_model_file,
    default_tokenizer_file,
)

_PROSE = (
    "the customer may return any item within thirty days of delivery for a full refund "
    "provided it is unused and in its original packaging refunds are issued to the original "
    "payment method within five business days after the warehouse receives the parcel "
    "exchanges follow the same window shipping costs for returns are covered when the item "
    "arrived damaged or was not what was ordered otherwise a flat fee applies gift cards and "
    "final sale items cannot be returned the support team answers questions about orders "
    "invoices accounts and deliveries by email or phone during business hours"
)
_WORDS = tuple(_PROSE.split(" "))


def make_texts(count: int, tokens: Callable[[random.Random], int], seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        # ~1.1 tokens per word for this vocabulary; the counts below are measured, not assumed.
        words = max(1, int(tokens(rng) / 1.1))
        texts.append(" ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + ".")
    return texts


class BareLoop:
    def __init__(self, threads: int) -> None:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session: Any = onnxruntime.InferenceSession(
            str(default_model_file()), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self.tokenizer = Tokenizer.from_file(str(default_tokenizer_file()))
        self.tokenizer.enable_padding()  # to the longest of each batch
        self.tokenizer.enable_truncation(max_length=MAX_SEQ_LENGTH)

    def embed(self, texts: Sequence[str], batch_size: int) -> np.ndarray[Any, Any]:
        out = []
        for start in range(0, len(texts), batch_size):
            encodings = self.tokenizer.encode_batch(list(texts[start : start + batch_size]))
            ids = np.array([e.ids for e in encodings], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
            types = np.array([e.type_ids for e in encodings], dtype=np.int64)
            (hidden,) = self.session.run(
                ["last_hidden_state"],
                {"input_ids": ids, "attention_mask": mask, "token_type_ids": types},
            )
            weights = mask[:, :, None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / weights.sum(axis=1)
            out.append(pooled / np.linalg.norm(pooled, axis=1, keepdims=True))
        return np.vstack(out)


def run_ours(ours: OnnxLocalEmbedder, texts: Sequence[str], batch_size: int) -> Any:
    return asyncio.run(embed_batched(ours, texts, batch_size=batch_size))


def timed(run: Callable[[], Any], repeat: int) -> float:
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=256, help="texts per set")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-size", type=int, default=32, help="texts per request")
    parser.add_argument("--inference-batch-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    arguments = parser.parse_args()

    sets = {
        "short (~40 tok)": make_texts(arguments.texts, lambda r: r.randint(30, 50), 1),
        "chunk (~250 tok)": make_texts(arguments.texts, lambda r: r.randint(235, 250), 2),
        "mixed (20-256)": make_texts(arguments.texts, lambda r: r.randint(20, 256), 3),
    }
    counter = Tokenizer.from_file(str(default_tokenizer_file()))
    counter.no_padding()
    counter.no_truncation()
    print(
        f"batch_size={arguments.batch_size} inference_batch_size="
        f"{arguments.inference_batch_size} texts/set={arguments.texts} "
        f"repeat={arguments.repeat} (median)"
    )
    print(
        f"{'set':<18} {'mean tok':>8} {'threads':>7} {'bare t/s':>9} {'ours t/s':>9} "
        f"{'ours/bare':>9} {'max |diff|':>10}"
    )
    for threads in arguments.threads:
        bare = BareLoop(threads)
        ours = OnnxLocalEmbedder(
            intra_op_threads=threads,
            inference_batch_size=arguments.inference_batch_size,
            # One run at a time, as the bare loop: the threads are what is compared.
            runs_per_request=1,
        )
        asyncio.run(ours.warm_up())
        for name, texts in sets.items():
            tokens = statistics.mean(
                min(MAX_SEQ_LENGTH, len(counter.encode(text).ids)) for text in texts
            )
            bare.embed(texts[:8], arguments.batch_size)  # warm both
            asyncio.run(embed_batched(ours, texts[:8], batch_size=arguments.batch_size))
            bare_seconds = timed(partial(bare.embed, texts, arguments.batch_size), arguments.repeat)
            ours_seconds = timed(
                partial(run_ours, ours, texts, arguments.batch_size), arguments.repeat
            )
            diff = float(
                np.abs(
                    bare.embed(texts, arguments.batch_size)
                    - asyncio.run(embed_batched(ours, texts, batch_size=arguments.batch_size))
                ).max()
            )
            bare_rate = len(texts) / bare_seconds
            ours_rate = len(texts) / ours_seconds
            print(
                f"{name:<18} {tokens:>8.0f} {threads:>7} {bare_rate:>9.1f} {ours_rate:>9.1f} "
                f"{ours_rate / bare_rate:>9.2f} {diff:>10.1e}"
            )


if __name__ == "__main__":
    main()

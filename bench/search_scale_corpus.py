"""The synthetic multi-tenant corpus of ``bench.search_latency``: tenants, documents, ACLs,
vectors, text and queries, all derived from (chunks, seed, vector kind), so that a reused
database and a fresh run of the script agree on every chunk's vector and on who may read it.

- 100 tenants (``t000`` ..), documents dealt to them in turn, 4-16 chunks per document.
- ACLs: every document is readable by ``group:everyone`` (the "all" principal), by 1-3 of
  the tenant's 20 groups ``group:gNN`` (a "typical" user in 3 groups reads ~27 % of the
  tenant), and about 1 % of each tenant's documents (at least one) by ``group:narrow``.
- Vectors (dimension 384, unit length): ``random`` is uniform on the sphere; ``clustered``
  gives each document a topic (one of 1,000 random centroids) and each chunk the topic plus
  noise of norm ~1, as real embeddings cluster. Queries are drawn the same way.
- Text: words drawn from the empirical word frequencies of the Python standard library's
  docstrings (the 5,000 commonest words; Zipf-like, "the" is 7 % of all words), 40-120
  words a chunk and a 1-3 word heading. Keyword queries are one common word (ranks 10-200,
  in 6-53 % of chunks) and one rarer word (ranks 200-2,000, in 0.4-6 % of chunks); the
  worst case of the keyword side, one common word alone, is measured too.
"""

from __future__ import annotations

import ast
import collections
import re
import sysconfig
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

# Bump when anything below changes what a (chunks, seed, vectors) corpus contains: a reused
# database records it and is refused when it differs.
CORPUS_VERSION = 1
DIMENSION = 384
TENANTS = 100
GROUPS = 20
TYPICAL_GROUPS = 3  # a typical user is in this many of the tenant's groups
NARROW_SHARE = 0.01
CHUNKS_PER_DOCUMENT = (4, 16)
CLUSTERS = 1000
CLUSTER_NOISE = 1.0  # noise norm relative to the unit centroid
VOCABULARY_SIZE = 5000
WORDS_PER_CHUNK = (40, 120)
COMMON_RANKS = (10, 200)
RARE_RANKS = (200, 2000)
BATCH = 50_000  # chunks generated (and copied) at a time

Array = np.ndarray[Any, Any]

PRINCIPAL_CLASSES = ("all", "typical", "1%")


def tenant_name(t: int) -> str:
    return f"t{t:03d}"


def document_uuid(d: int) -> uuid.UUID:
    return uuid.UUID(int=d + 1)


@cache
def vocabulary() -> tuple[tuple[str, ...], Array]:
    """The 5,000 commonest words of the standard library's docstrings and their shares."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "site-packages", "idlelib", "lib2to3", "tkinter", "turtledemo"}
    counts: collections.Counter[str] = collections.Counter()
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in skip or "tests" in parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    counts.update(re.findall(r"[a-z]{2,}", doc.lower()))
    common = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:VOCABULARY_SIZE]
    words = tuple(word for word, _ in common)
    shares = np.array([count for _, count in common], dtype=np.float64)
    return words, shares / shares.sum()


@dataclass(frozen=True)
class Corpus:
    """Who owns and may read each chunk. Documents are numbered 0.., chunks 0.. in document
    order; chunk i's id is ``str(i)``."""

    chunks: int
    seed: int
    vectors: str  # "random" | "clustered"
    chunk_document: Array  # chunk -> document
    document_tenant: Array  # document -> tenant
    document_groups: Array  # document -> bit mask of the tenant's groups allowed to READ
    document_narrow: Array  # document -> group:narrow may READ
    document_topic: Array  # document -> centroid (clustered vectors)

    @property
    def documents(self) -> int:
        return len(self.document_tenant)

    def document_chunks(self) -> Array:
        return np.bincount(self.chunk_document, minlength=self.documents)

    def readable(self, principal_class: str, tenant: int, group_mask: int) -> Array:
        """Chunk indices of ``tenant`` a principal of the class may read."""
        documents = self.document_tenant == tenant
        if principal_class == "typical":
            documents &= (self.document_groups & group_mask) != 0
        elif principal_class == "1%":
            documents &= self.document_narrow
        return np.flatnonzero(documents[self.chunk_document])


def build_corpus(chunks: int, seed: int, vectors: str) -> Corpus:
    rng = np.random.default_rng([seed, 1])
    sizes = rng.integers(CHUNKS_PER_DOCUMENT[0], CHUNKS_PER_DOCUMENT[1] + 1, size=chunks)
    ends = np.cumsum(sizes)
    documents = int(np.searchsorted(ends, chunks)) + 1
    chunk_document = np.repeat(np.arange(documents), sizes[:documents])[:chunks]
    document_tenant = np.arange(documents) % TENANTS
    groups_per_document = rng.integers(1, 4, size=documents)
    document_groups = np.zeros(documents, dtype=np.int64)
    for n in range(3):
        picked = rng.integers(GROUPS, size=documents)
        document_groups |= np.where(groups_per_document > n, 1 << picked, 0)
    document_narrow = rng.random(documents) < NARROW_SHARE
    for t in range(TENANTS):  # at least one narrow document per tenant
        own = np.flatnonzero(document_tenant == t)
        if len(own) and not document_narrow[own].any():
            document_narrow[own[0]] = True
    document_topic = rng.integers(CLUSTERS, size=documents)
    return Corpus(
        chunks,
        seed,
        vectors,
        chunk_document,
        document_tenant,
        document_groups,
        document_narrow,
        document_topic,
    )


def _normalised(vectors: Array) -> Array:
    out: Array = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return out


def centroids(seed: int) -> Array:
    rng = np.random.default_rng([seed, 2])
    return _normalised(rng.standard_normal((CLUSTERS, DIMENSION), dtype=np.float32))


def vector_batches(corpus: Corpus) -> Iterator[Array]:
    """Every chunk's vector, ``BATCH`` rows at a time (the same rows however often called)."""
    rng = np.random.default_rng([corpus.seed, 3])
    tops = centroids(corpus.seed) if corpus.vectors == "clustered" else None
    for start in range(0, corpus.chunks, BATCH):
        stop = min(corpus.chunks, start + BATCH)
        noise = rng.standard_normal((stop - start, DIMENSION), dtype=np.float32)
        if tops is not None:
            topic = corpus.document_topic[corpus.chunk_document[start:stop]]
            noise = tops[topic] + CLUSTER_NOISE * noise / np.sqrt(DIMENSION)
        yield _normalised(noise)


def all_vectors(corpus: Corpus) -> Array:
    return np.concatenate(list(vector_batches(corpus)))


def text_batches(corpus: Corpus) -> Iterator[tuple[list[str], list[list[str]]]]:
    """Every chunk's text and heading path, ``BATCH`` chunks at a time."""
    words, shares = vocabulary()
    vocab = np.array(words, dtype=object)
    rng = np.random.default_rng([corpus.seed, 4])
    for start in range(0, corpus.chunks, BATCH):
        count = min(corpus.chunks, start + BATCH) - start
        lengths = rng.integers(WORDS_PER_CHUNK[0], WORDS_PER_CHUNK[1] + 1, size=count)
        drawn = vocab[rng.choice(len(words), size=int(lengths.sum()), p=shares)]
        heading_lengths = rng.integers(1, 4, size=count)
        heading_words = vocab[rng.choice(len(words), size=int(heading_lengths.sum()), p=shares)]
        texts, headings = [], []
        at = heading_at = 0
        for n in range(count):
            texts.append(" ".join(drawn[at : at + lengths[n]]).capitalize() + ".")
            at += lengths[n]
            headings.append(
                [" ".join(heading_words[heading_at : heading_at + heading_lengths[n]]).title()]
            )
            heading_at += heading_lengths[n]
        yield texts, headings


@dataclass(frozen=True)
class Query:
    tenant: int
    group_mask: int  # the typical user's groups
    text: str  # a common and a rarer word
    common: str  # the common word alone
    vector: Array

    def principals(self, principal_class: str) -> tuple[str, ...]:
        if principal_class == "all":
            return ("group:everyone",)
        if principal_class == "1%":
            return ("user:narrow", "group:narrow")
        groups = [f"group:g{g:02d}" for g in range(GROUPS) if self.group_mask >> g & 1]
        return ("user:typical", *groups)


def build_queries(corpus: Corpus, count: int) -> list[Query]:
    words, _ = vocabulary()
    rng = np.random.default_rng([corpus.seed, 5])
    if corpus.vectors == "clustered":
        tops = centroids(corpus.seed)[rng.integers(CLUSTERS, size=count)]
        noise = rng.standard_normal((count, DIMENSION), dtype=np.float32)
        vectors = _normalised(tops + CLUSTER_NOISE * noise / np.sqrt(DIMENSION))
    else:
        vectors = _normalised(rng.standard_normal((count, DIMENSION), dtype=np.float32))
    queries = []
    for n in range(count):
        groups = rng.choice(GROUPS, size=TYPICAL_GROUPS, replace=False)
        common = words[int(rng.integers(*COMMON_RANKS))]
        rare = words[int(rng.integers(RARE_RANKS[0], min(RARE_RANKS[1], len(words))))]
        queries.append(
            Query(
                tenant=int(rng.integers(TENANTS)),
                group_mask=int(sum(1 << int(g) for g in groups)),
                text=f"{common} {rare}",
                common=common,
                vector=vectors[n],
            )
        )
    return queries


def exact_top(vectors: Array, allowed: Array, query: Array, k: int) -> list[int]:
    """The exact top ``k`` chunk indices among ``allowed`` by cosine similarity."""
    if len(allowed) == 0:
        return []
    sims = vectors[allowed] @ query
    take = min(k, len(allowed))
    best = np.argpartition(-sims, take - 1)[:take]
    return [int(allowed[i]) for i in best[np.argsort(-sims[best])]]

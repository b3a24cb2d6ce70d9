"""The code that turns a document into chunks, as a chunking strategy records it: our own
chunker's version, the versions of the parsers and splitter it calls, and the tokenizer that
counts the tokens (docs/architecture.md#index-generations).

The same bytes parsed by another pypdf, or counted by another tokenizer, can give other
sections, other chunk boundaries and so other chunks. The strategy id carries a digest of
these versions, so chunks written by older code are another generation's, and
`kb index check` can name the documents served from them; the versions themselves are
registered beside the generation (``index_generation.chunking_code``) to say what changed.

Package versions come from the installed distributions' metadata (importlib.metadata): no
parser is imported to learn its version.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from typing import Final, TypeAlias

from services.embedding.tokens import TokenizerSpec
from services.runtime.errors import ConfigError

# Raise it with any change to our parsing (pipeline/parsing/) or chunking (chunking.py) that
# can change the chunks of a document already indexed: the change then counts as older code.
# 2: adjacent small sections under the same heading path share a chunk.
CHUNKER_VERSION: Final = 2

# The distributions whose behaviour decides the chunks: the parsers of each media type,
# the splitter, and the tokenizer library that counts the tokens.
CHUNKING_PACKAGES: Final = (
    "pypdf",
    "python-docx",
    "selectolax",
    "markdown-it-py",
    "semchunk",
    "tokenizers",
)

# (name, version) pairs in a fixed order: part of a frozen, picklable strategy.
ChunkingCode: TypeAlias = tuple[tuple[str, str], ...]


def package_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        # Not installed is a state of the code too: installing it later changes the chunks.
        return "absent"


@functools.cache
def _file_digest(path: str) -> str:
    # The file's content, not its path: the same tokenizer installed elsewhere counts the same.
    try:
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()[:16]
    except OSError as error:
        raise ConfigError(f"tokenizer file {path} unreadable: {error}") from error


def tokenizer_code(tokenizer: TokenizerSpec) -> str:
    """What counts the tokens: the tokenizer file's content, or the approximate count (whose
    code is ours, versioned by ``CHUNKER_VERSION``)."""
    if tokenizer.tokenizer_file is None:
        return f"{tokenizer.name}:approximate"
    return f"{tokenizer.name}:sha256={_file_digest(tokenizer.tokenizer_file)}"


def chunking_code(tokenizer: TokenizerSpec) -> ChunkingCode:
    """The versions of everything that turns a document into chunks under ``tokenizer``."""
    return (
        ("chunker", str(CHUNKER_VERSION)),
        *((name, package_version(name)) for name in CHUNKING_PACKAGES),
        ("tokenizer", tokenizer_code(tokenizer)),
    )


@functools.lru_cache(maxsize=64)
def code_digest(code: ChunkingCode) -> str:
    """A short digest of ``code`` for the strategy id: the id is stored with every chunk and
    in two of its indexes, so it carries the digest, and the versions are registered once
    per generation. Remembered: the id is asked for every document."""
    text = json.dumps(list(code), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]

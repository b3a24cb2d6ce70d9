"""A process that starts a ParsePool, parses one document, prints its parse processes' pids
and waits: a test SIGKILLs it and watches what happens to those processes."""

from __future__ import annotations

import asyncio
import os
import uuid

from services.embedding.hashing import HashingEmbedder
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.pipeline.version_indexer import chunking_strategy


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


async def main() -> None:
    pool = ParsePool(workers=2)
    strategy = chunking_strategy(HashingEmbedder(dimension=8), max_tokens=64)
    for _ in range(2):
        await pool.parse_and_chunk(
            "text/plain",
            b"one paragraph\n\nanother one\n",
            document_id=uuid.uuid4(),
            version_number=1,
            strategy=strategy,
        )
    print(" ".join(map(str, descendants(os.getpid()))), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())

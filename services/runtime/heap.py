"""The Python heap of a long-running process: what start-up made is left out of the cyclic
garbage collector's later passes, and young collections run less often.

A full collection walks every tracked object; in an indexer most of them were made while
starting and live as long as the process, so each pass over them found nothing and cost
tens of milliseconds, a few times a minute at full load. Young collections ran every 700
new objects (a short note's Markdown tokens are a few hundred), each promoting the
documents then in flight to be walked again by the older passes (BENCHMARKS.md, the
indexer's CPU per document)."""

from __future__ import annotations

import gc
from typing import Final

# New container objects (net of those freed) that start a young collection; CPython's
# default is 700. A few megabytes of short-lived objects at most wait for it.
YOUNG_COLLECTION_THRESHOLD: Final = 10_000


def freeze_start_up_heap() -> int:
    """Collects what start-up left behind, then moves every surviving object to the
    collector's permanent generation; returns how many that is. Call once, when the
    process is ready for its work: what is made afterwards is collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def collect_young_less_often() -> int:
    """Young collections wait for ``YOUNG_COLLECTION_THRESHOLD`` new objects; the older
    generations' rules stay. Returns the threshold."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, old)
    return YOUNG_COLLECTION_THRESHOLD

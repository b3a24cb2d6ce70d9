"""The Python heap a long-running process builds at start (modules, classes, settings,
pools): left out of the cyclic garbage collector's later passes.

A full collection walks every tracked object; in an indexer most of them were made while
starting and live as long as the process, so each pass over them found nothing and cost
tens of milliseconds, a few times a minute at full load (BENCHMARKS.md, the indexer's CPU
per document)."""

from __future__ import annotations

import gc


def freeze_start_up_heap() -> int:
    """Collects what start-up left behind, then moves every surviving object to the
    collector's permanent generation; returns how many that is. Call once, when the
    process is ready for its work: what is made afterwards is collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

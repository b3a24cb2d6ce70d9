"""FOR CRASH TESTS ONLY: ``python -m tests.support.hanging_worker --tier T [--concurrency N]``
is ``kb indexer run`` built by the CLI's own builders, with the pipeline wrapped so that it
hangs until cancelled on every lease generation up to ``KB_TEST_ONLY_HANG_GENERATIONS``
(default 1). A test can then kill the worker mid-task; later generations (the takeover)
run the real pipeline."""

from __future__ import annotations

import argparse
import asyncio
import os

from services.indexer.pool import load_settings
from services.indexer.ports import DocumentVersionIndexer, IndexingOutcome
from services.indexer.task import Lease
from services.indexer.wiring import run_workers
from services.runtime.commands.cli_support import fail
from services.runtime.errors import KbError
from services.runtime.logging import configure_logging
from services.runtime.tracing.setup import configure_tracing


class HangingIndexer:
    """Hangs on lease generations ``<= hang_generations``, then runs ``inner``."""

    def __init__(self, inner: DocumentVersionIndexer, hang_generations: int) -> None:
        self._inner = inner
        self._hang_generations = hang_generations

    async def index(self, lease: Lease) -> IndexingOutcome:
        if lease.lease_attempt <= self._hang_generations:
            await asyncio.Event().wait()
        return await self._inner.index(lease)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tier", required=True)
    parser.add_argument("--concurrency", type=int, default=None)
    args = parser.parse_args()
    generations = int(os.environ.get("KB_TEST_ONLY_HANG_GENERATIONS", "1"))
    try:
        settings = load_settings()
        configure_logging(settings.log_level, settings.log_format, service="indexer")
        configure_tracing("kb-indexer")
        run_workers(
            settings,
            args.tier,
            args.concurrency or settings.indexer_concurrency,
            wrap=lambda inner: HangingIndexer(inner, generations),
        )
    except KbError as error:
        fail(error)


if __name__ == "__main__":
    main()

"""An ``Embedder`` whose every request goes through the provider's shared guard: the
breaker and the limiter before it, the outcome told to every process after it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

from services.embedding.guard.guard import ProviderGuard
from services.embedding.guard.quota import Purpose
from services.embedding.port import Embedder, PassedThroughIdentity, Vectors
from services.embedding.tokens import TokenCounter, approximate_tokens
from services.runtime.indexing.index_failures import IndexingFailed


# Mutable and compared by identity, as the plain class it was: a dataclass for its fields.
@dataclass(eq=False)
class GuardedEmbedder(PassedThroughIdentity):
    inner: Embedder
    guard: ProviderGuard
    _: KW_ONLY
    purpose: Purpose
    owner: str
    # The tokens bucket is charged what the texts count; without the model's counter,
    # the approximate one, which errs high (the quota is not overrun).
    count_tokens: TokenCounter | None = None

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """One request of ``inner``, when the guard lets it go. Raises what ``inner``
        raises (a Retry-After beyond the guard's cap replaced by the breaker's time), or the
        guard's EMBEDDING_UNAVAILABLE / EMBEDDING_RATE_LIMITED (not sent).
        A refused input (``InputRefused``) is the provider answering, not failing."""
        # Counting is a tokenizer pass over every text: only when a token rate charges it.
        metered = self.guard.meters_tokens
        count = self.count_tokens or approximate_tokens
        tokens = sum(count(text) for text in texts) if metered else 0
        await self.guard.before_request(tokens=tokens, purpose=self.purpose, owner=self.owner)
        try:
            vectors = await self.inner.embed(texts)
        except IndexingFailed as error:
            instead = await self.guard.after_request(
                owner=self.owner, error=error, purpose=self.purpose
            )
            if instead is not None:
                raise instead from error
            raise
        except (Exception, asyncio.CancelledError):
            # Cancelled, or a bug: nothing the provider said, nothing to tell the others.
            self.guard.abandon_request()
            raise
        await self.guard.after_request(owner=self.owner, error=None, purpose=self.purpose)
        return vectors

    async def aclose(self) -> None:
        await self.inner.aclose()

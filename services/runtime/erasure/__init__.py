"""What an erase removes (docs/architecture.md#document-lifecycle): the batches the
publisher's erase runs and `kb index check --repair` runs again to finish one, and what a
deleted document may not keep."""

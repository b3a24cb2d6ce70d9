"""The HTTP contract every app shares: problem details, request strictness and the base of
the wire models."""

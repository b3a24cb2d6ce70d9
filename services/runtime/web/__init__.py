"""The HTTP contract every app shares: problem details and request strictness."""

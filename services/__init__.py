"""kb-pipeline: from published to searchable, reliably."""

"""Backfill publishing: many documents or versions in one request (``POST .../documents/bulk``)."""

"""Backfill publishing: many documents or versions in one request (``POST .../documents/bulk``,
routed by ``services/publisher/web/bulk_routes.py``)."""

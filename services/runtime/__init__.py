"""Shared runtime: settings, database pool, named SQL, errors, logging, migrations."""

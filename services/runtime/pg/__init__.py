"""PostgreSQL plumbing every service shares: the pool and its error translation, named SQL,
migrations, records, the transaction port, coalesced reads and the clock.
"""

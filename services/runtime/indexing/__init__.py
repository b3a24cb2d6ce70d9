"""The indexing vocabulary every service shares: the index task, failure codes, media types and
the search-version lag.
"""

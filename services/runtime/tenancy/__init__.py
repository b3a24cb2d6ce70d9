"""Tenants and who may read what: tenant ids and authentication, principals, the served ACL and
the row-security wall.
"""

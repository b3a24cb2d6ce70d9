"""The relay service."""

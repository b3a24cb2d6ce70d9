"""The publisher service."""

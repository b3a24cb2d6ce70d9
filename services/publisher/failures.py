"""What a tenant is told about a failed index task: its stable code and a fixed message.

The stored ``error_message`` is for operators (``kb tasks show``, logs): it may name hosts,
files or SQL. Tenants get a text chosen by the code alone, so nothing internal can reach
them whatever the message holds.
"""

from __future__ import annotations

from typing import Final

TENANT_MESSAGES: Final = {
    "UNSUPPORTED_DOCUMENT": "The document's format cannot be indexed.",
    "DOCUMENT_PARSE_FAILED": "The document could not be parsed.",
    "DOCUMENT_PARSE_TIMEOUT": "Parsing the document took too long.",
    "DOCUMENT_EMPTY": "The document holds no text to index.",
    "DOCUMENT_TOO_LARGE": "The document is too large to index.",
    "EMBEDDING_RATE_LIMITED": "The embedding service is rate-limiting; indexing will retry.",
    "EMBEDDING_TIMEOUT": "The embedding service did not answer in time.",
    "EMBEDDING_UNAVAILABLE": "The embedding service is unavailable.",
    "EMBEDDING_RESPONSE_INVALID": "The embedding service gave an invalid answer.",
    "EMBEDDING_RESPONSE_MALFORMED": (
        "The embedding service gave an unreadable answer; indexing will retry."
    ),
    "EMBEDDING_MODEL_CHANGED": "The embedding model changed while indexing.",
    "LEASE_ATTEMPTS_EXHAUSTED": "Indexing was interrupted too many times.",
    "DOCUMENT_DELETED": "The document was deleted; its indexing was stopped.",
    "VERSION_CONTENT_REMOVED": (
        "The version was superseded and its content removed by retention; publish a new one."
    ),
}
INTERNAL_FAILURE_MESSAGE: Final = "Indexing failed; an operator can see the details."


def tenant_failure_message(error_code: str | None) -> str | None:
    """The fixed text for ``error_code`` (``None`` without a code); any code not listed
    (internal errors included) gets the generic text."""
    if error_code is None:
        return None
    return TENANT_MESSAGES.get(error_code, INTERNAL_FAILURE_MESSAGE)

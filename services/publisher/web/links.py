"""OpenAPI links of the publisher's answers: which later call takes which of their values.

A client reads them as "what to do next" (publish the version just uploaded, poll its
document's status, follow its index task); API fuzzers (schemathesis) chain calls along
them, so that they reach the states behind real ids (tests/security/test_api_stateful.py).
Every link stays in the caller's tenant (``$request.path.tenantId``).

A link's ``requestBody`` holds runtime expressions inside a literal object: the fields it
names come from the answer, the others are the caller's (a publish's ``acl``).
"""

from __future__ import annotations

from typing import Any, Final

_SAME_TENANT: Final = {"tenantId": "$request.path.tenantId"}
# The document the answer names: every link of a single document's answer follows it.
_ANSWERED: Final = "$response.body#/documentId"


def _link(operation_id: str, description: str, **parameters: str) -> dict[str, Any]:
    return {
        "operationId": operation_id,
        "description": description,
        "parameters": {**_SAME_TENANT, **parameters},
    }


def _publish(description: str, version: str, document_id: str = _ANSWERED) -> dict[str, Any]:
    link = _link("publish_version", description, documentId=document_id, versionNumber=version)
    link["requestBody"] = {"revision": "$response.body#/revision"}
    return link


def _status(document_id: str = _ANSWERED) -> dict[str, Any]:
    return _link("document_status", "Where the document stands.", documentId=document_id)


def _add_version(document_id: str = _ANSWERED) -> dict[str, Any]:
    return _link("add_version", "Upload the document's next version.", documentId=document_id)


def _index_task(task_id: str) -> dict[str, Any]:
    return _link("index_task", "The index task of the publish.", taskId=task_id)


def links(**named: dict[str, Any]) -> dict[str, Any]:
    """The ``responses`` entry of one success status that holds ``named`` links."""
    return {"links": named}


AFTER_UPLOAD: Final = links(
    PublishVersion=_publish(
        "Publish the version just uploaded, at the document's revision it answered.",
        "$response.body#/versionNumber",
    ),
    DocumentStatus=_status(),
    AddVersion=_add_version(),
)

AFTER_PUBLISH: Final = links(
    IndexTask=_index_task("$response.body#/indexTaskId"),
    DocumentStatus=_status(),
    Republish=_publish(
        "Publish the same version again, e.g. with another ACL (a new index task).",
        "$response.body#/versionNumber",
    ),
    AddVersion=_add_version(),
)

AFTER_STATUS: Final = links(
    PublishLatest=_publish(
        "Publish the document's latest version at its current revision.",
        "$response.body#/latestVersion",
    ),
    IndexTask=_index_task("$response.body#/indexTaskId"),
    AddVersion=_add_version(),
    Delete=_link(
        "delete_document",
        "Delete the document at its current revision.",
        documentId=_ANSWERED,
        revision="$response.body#/revision",
    ),
)

AFTER_DELETE: Final = links(
    DocumentStatus=_status(),
    # Refused (409 DOCUMENT_DELETED): a delete is final.
    AddVersion=_add_version(),
)

AFTER_ERASE: Final = links(DocumentStatus=_status())

AFTER_INDEX_TASK: Final = links(DocumentStatus=_status())

# The first item's; a fuzzer gets the others by sending one item at a time.
AFTER_BULK: Final = links(
    DocumentStatus=_status("$response.body#/results/0/documentId"),
    IndexTask=_index_task("$response.body#/results/0/indexTaskId"),
)

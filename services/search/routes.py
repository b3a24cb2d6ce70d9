"""The search route (docs/architecture.md#search): ``POST /v1/tenants/{tenantId}/search``.

Mounted into the app the tenant-auth middleware wraps (services/app.py), and failing closed
on its own should a request arrive unauthenticated. Errors are problem+json. When the query
cannot be embedded, hybrid answers 200 from the keyword list alone with
``"degraded": "keyword-only"``, and vector answers 503 with the provider's code and a
Retry-After of the provider's time (rounded up; 5 s when it named none).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Final

from fastapi import APIRouter, Depends, Path, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer
from pydantic import AfterValidator, Field, StringConstraints

from services.runtime.auth.keys import Scope
from services.runtime.auth.tokens import MAX_TOKEN_CHARS
from services.runtime.fair_share.middleware import LIMITED_RESPONSE
from services.runtime.fair_share.shares import TenantLimited
from services.runtime.logging import get_logger
from services.runtime.tenancy.tenant_auth import (
    PrincipalsRequired,
    authenticated_caller,
    require_scope,
    search_principals,
)
from services.runtime.web.http_problem import PROBLEM_RESPONSE, problem_response
from services.runtime.web.wire import ApiModel
from services.search.replicas import TOKEN_PATTERN, parse_token
from services.search.searcher import (
    DEFAULT_TOP_K,
    MAX_FILTER_DOCUMENTS,
    MAX_HEADING_CHARS,
    MAX_HEADING_PREFIX_DEPTH,
    MAX_PRINCIPAL_CHARS,
    MAX_PRINCIPALS,
    MAX_QUERY_CHARS,
    MAX_TOP_K,
    MIN_TOP_K,
    Degraded,
    QueryEmbeddingUnavailable,
    SearchFilter,
    SearchMode,
    SearchRequest,
    SearchResult,
    SearchService,
)

log = get_logger(__name__)


def _no_nul(value: str) -> str:
    # PostgreSQL text cannot hold NUL: refuse it here (422) instead of failing in the driver.
    if "\x00" in value:
        raise ValueError("must not contain the NUL character")
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must contain more than whitespace")
    return value


QueryText = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_QUERY_CHARS),
    AfterValidator(_no_nul),
    AfterValidator(_not_blank),
]
Principal = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_PRINCIPAL_CHARS), AfterValidator(_no_nul)
]
SearchToken = Annotated[str, StringConstraints(pattern=TOKEN_PATTERN)]
MAX_AFTER_TOKENS: Final = 100
Heading = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_HEADING_CHARS), AfterValidator(_no_nul)
]


class SearchFilterBody(ApiModel):
    document_ids: list[uuid.UUID] | None = Field(
        default=None,
        max_length=MAX_FILTER_DOCUMENTS,
        description="Only chunks of these documents.",
    )
    heading_prefix: list[Heading] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_HEADING_PREFIX_DEPTH,
        description='Only chunks whose heading path starts with these headings, e.g. ["Refunds"].',
    )


class SearchBody(ApiModel):
    query: QueryText
    top_k: int = Field(default=DEFAULT_TOP_K, ge=MIN_TOP_K, le=MAX_TOP_K, strict=True)
    principals: list[Principal] | None = Field(
        default=None,
        max_length=MAX_PRINCIPALS,
        description="Who is asking: only documents whose READ ACL names one of them are "
        "searched. An empty list matches nothing. Required unless a principalToken is sent "
        "or the key is bound to principals; refused (400 PRINCIPALS_NOT_ALLOWED) with either.",
    )
    principal_token: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TOKEN_CHARS,
        description="An end user's signed principal token (a JWT from the tenant's own back "
        "end, verified with a key registered by `kb tenants verification-keys add`): the "
        "search then runs with the token's principals only. 401 PRINCIPAL_TOKEN_INVALID "
        "when it does not verify.",
    )
    mode: SearchMode = SearchMode.HYBRID
    filter: SearchFilterBody | None = None
    after: list[SearchToken] | None = Field(
        default=None,
        max_length=MAX_AFTER_TOKENS,
        description="Search tokens (`searchToken` of a document's status, or the "
        "`search_token` Kafka header of its DocumentSearchVersionSwitched event): the search "
        "is answered only by a database that has replayed all of them, so it sees at least "
        "the versions those documents were searchable with when the tokens were issued. "
        "Without it, a search on a read replica may lag by the replica's lag. A token "
        "naming a position the database has not written is refused: 422 SEARCH_TOKEN_AHEAD.",
    )


class SearchHitBody(ApiModel):
    document_id: uuid.UUID
    title: str
    version_number: int
    chunk_id: str
    heading_path: list[str]
    text: str
    score: float
    media_type: str = Field(
        description="The media type the hit's document version was uploaded as (e.g. "
        '"text/markdown", "text/html", "application/pdf").'
    )


class GenerationBody(ApiModel):
    embedding_model: str
    dimension: int
    generation_id: int | None = Field(
        description="The search generation that served the tenant's search (`kb index "
        "generations list`); null while the database has none yet and search reads the "
        "configured embedding model.",
    )


class SearchResponse(ApiModel):
    results: list[SearchHitBody]
    generation: GenerationBody
    took_ms: float
    degraded: Degraded | None = Field(
        default=None,
        description='null when the answer is what the mode asked for. "keyword-only": a '
        "hybrid search whose query could not be embedded (the embedding provider throttled, "
        "was down or too slow) answered from the keyword list alone, ranked as mode keyword "
        "ranks it.",
    )


bearer = HTTPBearer(
    auto_error=False,
    scheme_name="TenantApiKey",
    description="A tenant API key (`kb.<tenant>.<secret>`) with the `search` (or `admin`) scope.",
)

TenantId = Annotated[str, Path(alias="tenantId")]


def _require_tenant(request: Request, tenant_id: TenantId) -> None:
    require_scope(request, tenant_id, Scope.SEARCH)


search_router = APIRouter(
    prefix="/v1/tenants/{tenantId}",
    dependencies=[Security(bearer), Depends(_require_tenant)],
)


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: PROBLEM_RESPONSE for status in sorted(set(statuses))}


# An OpenAPI link (as the publisher's answers have, services/publisher/web/links.py): the first
# hit's document status, an operation of the app this router is mounted into.
_AFTER_SEARCH: Final[dict[str, Any]] = {
    "links": {
        "DocumentStatus": {
            "operationId": "document_status",
            "description": "Where the first hit's document stands (needs the publish scope).",
            "parameters": {
                "tenantId": "$request.path.tenantId",
                "documentId": "$response.body#/results/0/documentId",
            },
        }
    }
}


@search_router.post(
    "/search",
    response_model=SearchResponse,
    # 429: the tenant's fair share (services/runtime/fair_share).
    responses={
        **_problems(400, 401, 403, 413, 422, 503),
        429: LIMITED_RESPONSE,
        200: _AFTER_SEARCH,
    },
    summary="Search the tenant's searchable documents that the principals may read",
    description="When the query cannot be embedded, a hybrid search answers from the keyword "
    'list alone with `"degraded": "keyword-only"`; a vector search answers 503 with '
    "Retry-After.",
)
async def search(
    request: Request, tenant_id: TenantId, body: SearchBody
) -> SearchResponse | JSONResponse:
    searcher: SearchService = request.app.state.searcher
    # Who the search runs as comes from the credentials when they decide it: the key's fixed
    # principals, or a verified principal token's (services/runtime/tenancy/tenant_auth.py).
    try:
        principals, claims = await search_principals(
            authenticated_caller(request, tenant_id),
            body.principals,
            body.principal_token,
            max_principals=MAX_PRINCIPALS,
            max_principal_chars=MAX_PRINCIPAL_CHARS,
        )
    except PrincipalsRequired as error:
        # The answer a body without principals always had: a validation failure naming
        # the field.
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body", "principals"), "msg": error.message}]
        ) from None
    flt = body.filter
    search_request = SearchRequest(
        tenant_id=tenant_id,
        query=body.query,
        principals=principals,
        top_k=body.top_k,
        mode=body.mode,
        filter=SearchFilter(
            document_ids=tuple(flt.document_ids) if flt and flt.document_ids is not None else None,
            heading_prefix=(
                tuple(flt.heading_prefix) if flt and flt.heading_prefix is not None else None
            ),
        ),
        read_after=max((parse_token(token) for token in body.after), default=None)
        if body.after
        else None,
    )
    try:
        result: SearchResult = await searcher.search(search_request)
    except QueryEmbeddingUnavailable as error:
        return _embedding_unavailable(request, tenant_id, body, error)
    except TenantLimited as refusal:
        # No search slot in time (services/runtime/fair_share/phases.py): 429 with when to
        # retry, as the middleware answers a tenant beyond its share.
        return problem_response(
            429,
            refusal.code,
            refusal.message,
            instance=request.url.path,
            headers={"Retry-After": str(refusal.retry_after_seconds)},
        )
    log.info(
        "search.served",
        tenant_id=tenant_id,
        mode=body.mode.value,
        top_k=body.top_k,
        results=len(result.results),
        generation_id=result.generation.generation_id,
        took_ms=result.took_ms,
        degraded=result.degraded.value if result.degraded else None,
        principal_token_kid=claims.kid if claims is not None else None,
        read_from=result.read_from,
    )
    return SearchResponse.model_validate(result)


def _embedding_unavailable(
    request: Request, tenant_id: str, body: SearchBody, error: QueryEmbeddingUnavailable
) -> JSONResponse:
    """503 with the provider's code and when to retry: the provider's own time, not the
    one second the app gives a busy database."""
    retry_after = error.retry_after
    log.warning(
        "search.unavailable",
        tenant_id=tenant_id,
        mode=body.mode.value,
        error_code=error.code,
        reason=error.reason,
        retry_after_seconds=retry_after,
    )
    return problem_response(
        503,
        error.code,
        "the query could not be embedded now; retry after the time in Retry-After, or "
        "search with mode keyword",
        instance=request.url.path,
        headers={"Retry-After": str(retry_after)},
    )

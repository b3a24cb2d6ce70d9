"""Operations routes: liveness, readiness (ready / not ready, details in the log), metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.publisher.metrics import PublisherMetrics
from services.publisher.web.readiness import ReadinessProbe
from services.publisher.web.wire import HealthResponse
from services.runtime.web.http_problem import PROBLEM_RESPONSE, problem_response

ops_router = APIRouter()


@ops_router.get("/healthz", response_model=HealthResponse, summary="Liveness")
async def healthz() -> HealthResponse:
    return HealthResponse(status="ok")


@ops_router.get(
    "/readyz",
    response_model=HealthResponse,
    responses={503: PROBLEM_RESPONSE},
    summary="Readiness: the database answers and every migration is applied",
)
async def readyz(request: Request) -> HealthResponse | JSONResponse:
    probe: ReadinessProbe = request.app.state.readiness
    if not await probe.is_ready():
        return problem_response(
            503, "NOT_READY", "the service is not ready", instance=request.url.path
        )
    return HealthResponse(status="ready")


@ops_router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
    summary="Prometheus metrics",
)
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics
    assert isinstance(registry, PublisherMetrics)
    # The app's own metrics, then the process-wide ones (process, search lag).
    body = generate_latest(registry.registry) + generate_latest(REGISTRY)
    return Response(body, media_type=CONTENT_TYPE_LATEST)

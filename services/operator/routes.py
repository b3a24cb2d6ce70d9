"""The operator page at /ui: server-rendered HTML over the operator store.

Sign-in takes an operator key (never a tenant key) and sets an HttpOnly, SameSite=Strict
session cookie, Secure unless KB_OPERATOR_SECURE_COOKIE=false; failed sign-ins are throttled
per client address like failed keys on /v1; every POST carries the session's CSRF token.
Without JavaScript every page works (live refresh is the only script). Every list is
paginated.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode

from fastapi import APIRouter, Depends, FastAPI, Form, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from services.operator import auth, charts
from services.operator.context import OperatorContext
from services.operator.store_pg import Session
from services.runtime.auth.throttle import FailedAuthThrottle, Refused, peer_host
from services.runtime.errors import KbError
from services.runtime.logging import get_logger

log = get_logger(__name__)

_HERE = Path(__file__).resolve().parent
_STATIC = {"ui.css": "text/css", "refresh.js": "text/javascript"}
_templates = Environment(
    loader=FileSystemLoader(_HERE / "templates"),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)
LOGIN_COOKIE = "kb_operator_login"
_SIGN_IN_THROTTLE = "operator_sign_in_throttle"
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self' data:; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'; connect-src 'self'"
    ),
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
}

router = APIRouter(prefix="/ui", include_in_schema=False)


def _context(request: Request) -> OperatorContext:
    context: OperatorContext = request.app.state.operator
    return context


def _render(name: str, status_code: int = 200, **values: Any) -> HTMLResponse:
    html = _templates.get_template(name).render(**values)
    return HTMLResponse(html, status_code=status_code, headers=_SECURITY_HEADERS)


def _page(session: Session, name: str, status_code: int = 200, **values: Any) -> HTMLResponse:
    """A page of a signed-in operator: their name in the header, their CSRF token in every
    form."""
    return _render(name, status_code, operator=session.operator, csrf=session.csrf_token, **values)


async def _session(request: Request) -> Session | None:
    token = request.cookies.get(auth.SESSION_COOKIE)
    if not token:
        return None
    return await _context(request).store.session(auth.digest(token))


class _SignIn(Exception):
    """No valid session: GETs go to the sign-in page."""


async def require_session(request: Request) -> Session:
    session = await _session(request)
    if session is None:
        if request.method == "GET":
            raise _SignIn
        raise HTTPException(status_code=403, detail="sign in first")
    return session


def _check_csrf(session: Session, presented: str) -> None:
    if not presented or not auth.same_secret(presented, session.csrf_token):
        raise HTTPException(status_code=403, detail="the form's CSRF token does not match")


SessionDep = Annotated[Session, Depends(require_session)]
# Where a paged list starts (?offset=, ?chunks=).
PageOffset = Annotated[int, Query(ge=0, le=10_000_000)]


# --- static files and sign-in ------------------------------------------------------------


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in _STATIC:
        raise HTTPException(status_code=404)
    return FileResponse(_HERE / "static" / name, media_type=_STATIC[name])


@router.get("/login")
async def login_page(request: Request, error: str | None = None) -> HTMLResponse:
    return _login_form(request, error=error)


def _login_form(request: Request, status_code: int = 200, **values: Any) -> HTMLResponse:
    login_token = auth.new_csrf_token()
    response = _render("login.html", status_code, login_token=login_token, operator=None, **values)
    response.set_cookie(
        LOGIN_COOKIE,
        login_token,
        httponly=True,
        samesite="strict",
        path="/ui",
        secure=_context(request).settings.operator_secure_cookie,
    )
    return response


def _sign_in_throttle(request: Request) -> FailedAuthThrottle:
    # One per app, made on first use: the settings may arrive in the app's lifespan.
    throttle: FailedAuthThrottle | None = getattr(request.app.state, _SIGN_IN_THROTTLE, None)
    if throttle is None:
        throttle = auth.sign_in_throttle(_context(request).settings)
        setattr(request.app.state, _SIGN_IN_THROTTLE, throttle)
    return throttle


@router.post("/login")
async def login(
    request: Request,
    token: Annotated[str, Form(max_length=500)] = "",
    login_token: Annotated[str, Form(max_length=100)] = "",
) -> Response:
    expected = request.cookies.get(LOGIN_COOKIE, "")
    if not expected or not auth.same_secret(login_token, expected):
        raise HTTPException(status_code=403, detail="the sign-in form expired: load it again")
    context = _context(request)
    throttle = _sign_in_throttle(request)
    host = peer_host(request.scope)
    # Reserved before the key is looked at: concurrent guesses cannot outrun the count.
    reservation = await throttle.reserve(host)
    if isinstance(reservation, Refused):
        wait = max(1, math.ceil(reservation.retry_after))
        refused = _login_form(request, 429, throttled=wait)
        refused.headers["Retry-After"] = str(wait)
        return refused
    try:
        operator = await _operator_for(context, token.strip())
    except BaseException:
        reservation.release()
        raise
    if operator is None:
        if reservation.failed():  # once per address and episode, not per refusal
            log.warning("operator.sign_in_throttled", client_address=throttle.address(host))
        log.warning("operator.sign_in_refused")
        return RedirectResponse("/ui/login?error=1", status_code=303)
    reservation.release()
    session_token = auth.new_session_token()
    await context.store.create_session(
        auth.digest(session_token),
        operator,
        auth.new_csrf_token(),
        context.settings.operator_session_seconds,
    )
    log.info("operator.signed_in", operator=operator)
    response = RedirectResponse("/ui", status_code=303)
    response.set_cookie(
        auth.SESSION_COOKIE,
        session_token,
        max_age=int(context.settings.operator_session_seconds),
        httponly=True,
        samesite="strict",
        path="/ui",
        secure=context.settings.operator_secure_cookie,
    )
    response.delete_cookie(LOGIN_COOKIE, path="/ui")
    return response


async def _operator_for(context: OperatorContext, token: str) -> str | None:
    """The operator a key belongs to. Tenant keys (kb.<tenant>.<secret>) never qualify."""
    if not token:
        return None
    configured = context.settings.operator_token
    if configured is not None and auth.same_secret(token, configured.get_secret_value()):
        return auth.ENV_OPERATOR
    if not token.startswith(auth.OPERATOR_KEY_PREFIX):
        return None
    return await context.store.operator_for_key(auth.digest(token))


@router.post("/logout")
async def logout(
    request: Request, session: SessionDep, csrf: Annotated[str, Form(max_length=100)] = ""
) -> Response:
    _check_csrf(session, csrf)
    token = request.cookies.get(auth.SESSION_COOKIE, "")
    await _context(request).store.end_session(auth.digest(token))
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(auth.SESSION_COOKIE, path="/ui")
    return response


# --- pages -------------------------------------------------------------------------------


def _search_replicas(request: Request) -> list[Any]:
    views = getattr(request.app.state, "search_replicas", None)
    return list(views()) if callable(views) else []


@router.get("")
async def overview(request: Request, session: SessionDep) -> HTMLResponse:
    context = _context(request)
    store = context.store
    tiers = await store.tiers(context.settings.operator_expiring_within_seconds)
    end, finished, latencies = await store.last_hour()
    minutes = charts.minutes(end, finished)
    buckets = charts.latency_buckets(end, latencies)
    all_latencies = [float(row["seconds"]) for row in latencies]
    return _page(
        session,
        "overview.html",
        tiers=tiers,
        totals={key: sum(int(t[key]) for t in tiers) for key in _TOTALS},
        backlog=await context.backlog(),
        partitions=await store.relay_partitions(),
        providers=await store.embedding_providers(),
        lag=await store.search_lag(),
        # The app's search replicas (KB_SEARCH_DATABASE_URLS): a callable listing them.
        search_replicas=_search_replicas(request),
        generations=await store.generations(),
        tasks_chart=charts.tasks_chart(minutes),
        latency_chart=charts.latency_chart(buckets),
        hour={
            "succeeded": sum(m.succeeded for m in minutes),
            "dead": sum(m.dead for m in minutes),
            "p50": charts.percentile(all_latencies, 50),
            "p99": charts.percentile(all_latencies, 99),
            "switches": len(all_latencies),
        },
        expiring_within=context.settings.operator_expiring_within_seconds,
        lifecycle=await store.lifecycle_totals(context.retention_days),
        rendered_at=end,
    )


_TOTALS = ("due", "running", "retry_waiting", "dead", "leases_expiring", "leases_expired")


@router.get("/tenants")
async def tenants(
    request: Request,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=63)] = None,
) -> HTMLResponse:
    context = _context(request)
    limit = context.settings.operator_page_size
    rows = await context.store.tenants(after, limit + 1)
    return _page(
        session,
        "tenants.html",
        tenants=rows[:limit],
        next_after=rows[limit - 1]["tenant_id"] if len(rows) > limit else None,
    )


@router.get("/tenants/{tenant_id}/documents")
async def documents(
    request: Request,
    session: SessionDep,
    tenant_id: str,
    offset: PageOffset = 0,
) -> HTMLResponse:
    context = _context(request)
    page = await context.store.documents(tenant_id, offset, context.settings.operator_page_size)
    return _page(session, "documents.html", tenant_id=tenant_id, page=page)


@router.get("/tenants/{tenant_id}/documents/{document_id}")
async def document(
    request: Request,
    session: SessionDep,
    tenant_id: str,
    document_id: uuid.UUID,
    chunks: PageOffset = 0,
) -> HTMLResponse:
    context = _context(request)
    found = await context.store.document(
        tenant_id, document_id, chunk_offset=chunks, limit=context.settings.operator_page_size
    )
    if found is None:
        return _page(
            session,
            "not_found.html",
            status_code=404,
            what=f"document {document_id} of tenant {tenant_id}",
        )
    return _page(session, "document.html", tenant_id=tenant_id, doc=found)


@router.get("/lifecycle")
async def lifecycle(request: Request, session: SessionDep) -> HTMLResponse:
    """Deletes, erasures (the audit table) and what retention removed."""
    context = _context(request)
    return _page(
        session,
        "lifecycle.html",
        totals=await context.store.lifecycle_totals(context.retention_days),
        recent=await context.store.lifecycle(context.settings.operator_page_size),
        retention_days=context.retention_days,
    )


@router.get("/dead")
async def dead_tasks(
    request: Request,
    session: SessionDep,
    tier: Annotated[str | None, Query(max_length=32)] = None,
    tenant: Annotated[str | None, Query(max_length=63)] = None,
    code: Annotated[str | None, Query(max_length=100)] = None,
    offset: PageOffset = 0,
    done: Annotated[int | None, Query(ge=0, le=10_000)] = None,
    failed: Annotated[int | None, Query(ge=0, le=10_000)] = None,
) -> HTMLResponse:
    context = _context(request)
    filters = {"tier": tier or None, "tenant": tenant or None, "code": code or None}
    page = await context.store.dead_tasks(
        tier=filters["tier"],
        tenant_id=filters["tenant"],
        error_code=filters["code"],
        offset=offset,
        limit=context.settings.operator_page_size,
    )
    query = {k: v for k, v in filters.items() if v}
    return _page(
        session,
        "dead.html",
        page=page,
        filters=filters,
        query=urlencode(query),
        requeues=await context.store.recent_requeues(10),
        done=done,
        failed=failed,
    )


@router.post("/dead/requeue")
async def requeue(
    request: Request,
    session: SessionDep,
    csrf: Annotated[str, Form(max_length=100)] = "",
    task_id: Annotated[list[str] | None, Form()] = None,
    back: Annotated[str, Form(max_length=500)] = "",
) -> Response:
    _check_csrf(session, csrf)
    context = _context(request)
    ids = task_id or []
    if len(ids) > context.settings.operator_page_size:
        raise HTTPException(status_code=422, detail="too many tasks at once")
    done = failed = 0
    for raw in ids:
        try:
            wanted = uuid.UUID(raw)
        except ValueError:
            failed += 1
            continue
        try:
            await context.requeue(wanted, f"operator:{session.operator}")
            done += 1
            log.info("operator.requeued", task_id=str(wanted), operator=session.operator)
        except KbError as error:  # not DEAD any more, gone: counted, the rest goes on
            failed += 1
            log.warning("operator.requeue_refused", task_id=raw, error_code=error.code)
    # Back to the same filtered list; only the list's own filters survive the trip.
    kept = [(k, v) for k, v in parse_qsl(back) if k in ("tier", "tenant", "code")]
    query = urlencode([*kept, ("done", done), ("failed", failed)])
    return RedirectResponse(f"/ui/dead?{query}", status_code=303)


async def _to_sign_in(request: Request, exc: Exception) -> Response:
    return RedirectResponse("/ui/login", status_code=303)


def mount_operator(app: FastAPI, context: OperatorContext | None = None) -> None:
    """Add /ui to ``app``; ``context`` now, or later in ``app.state.operator`` (lifespan)."""
    if context is not None:
        app.state.operator = context
    app.include_router(router)
    app.add_exception_handler(_SignIn, _to_sign_in)

"""The bulk request's multipart body, read strictly (:mod:`services.publisher.strict_form`):
every text part UTF-8 whatever charset the request claims (the ``items`` part is JSON, UTF-8
between systems: RFC 8259, 8.1), every ``file`` part with a filename. A body that is not
multipart/form-data, or that cannot be read so, refuses the request (400 ``BULK_INVALID``).
"""

from __future__ import annotations

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request

from services.publisher.strict_form import is_multipart, read_multipart
from services.runtime.errors import BadInput


async def read_form(request: Request, *, max_files: int, max_fields: int) -> FormData:
    """The request's parts: files as uploads, the others as UTF-8 text; BadInput
    (``BULK_INVALID``) when the body is not multipart/form-data this parser can read."""
    if not is_multipart(request):
        raise BadInput("the request must be multipart/form-data", code="BULK_INVALID")
    try:
        return await read_multipart(request, max_files=max_files, max_fields=max_fields)
    except MultiPartException as error:
        raise BadInput(error.message, code="BULK_INVALID") from None
    except ClientDisconnect as gone:
        # What FastAPI raises for a single upload whose client hangs up: answered 400 inside
        # the app (so the request metrics count a 400, not a 500) and logged as a hang-up.
        raise HTTPException(400, "the client disconnected") from gone

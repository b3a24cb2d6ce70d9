"""Multipart bodies read strictly, for every upload: the single ones (``web/routes.py``, through
:class:`StrictFormRoute`) and the bulk one (``bulk/form.py``).

Starlette decodes a text part that is not valid in the request's charset as Latin-1,
silently (``_user_safe_decode``): a title sent as ``ff fe`` became "ÿþ", and a request
claiming ``charset=latin-1`` turned a UTF-8 "ü" into "Ã¼". A form's text parts and the JSON
they may hold are UTF-8 between systems (RFC 7578, 5.1.2; RFC 8259, 8.1), so every text
part must be UTF-8 whatever charset the request claims; one that is not makes the body
unreadable, as does a ``file`` part without a filename (RFC 7578, 4.2: a file's part names
its file), which the parser would otherwise take for a text field.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextlib import aclosing
from typing import Any

from fastapi.routing import APIRoute
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import Response


class _Utf8MultiPartParser(MultiPartParser):
    file_field = "file"

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is not None:
            super().on_part_end()
            return
        if part.field_name == self.file_field:
            # Without a filename a part is a text field to the parser, its content type
            # dropped: refused, rather than guessed back into a file.
            position = sum(1 for name, _ in self.items if name == self.file_field)
            raise MultiPartException(
                f"file part {position} has no filename: send each file as "
                f'Content-Disposition: form-data; name="{self.file_field}"; filename="..."'
            )
        try:
            # Strict: lone surrogates (ed a0 80) and overlong forms are refused as well.
            text = bytes(part.data).decode("utf-8")
        except UnicodeDecodeError as error:
            raise MultiPartException(
                f"the {part.field_name[:40]!r} part is not UTF-8 (byte {error.start})"
            ) from None
        self.items.append((part.field_name, text))


def is_multipart(request: Request) -> bool:
    media_type = request.headers.get("content-type", "").split(";", 1)[0]
    return media_type.strip().lower() == "multipart/form-data"


async def read_multipart(
    request: Request,
    *,
    max_files: int | float,
    max_fields: int | float,
    max_part_size: int = MultiPartParser.max_part_size,
) -> FormData:
    """The request's parts: files as uploads, the others as UTF-8 text. Raises
    ``MultiPartException`` (its ``message`` fit for the client) when the body cannot be
    read so; each route answers that with its own code."""
    async with aclosing(request.stream()) as stream:
        parser = _Utf8MultiPartParser(
            request.headers,
            stream,
            max_files=max_files,
            max_fields=max_fields,
            max_part_size=max_part_size,
        )
        return await parser.parse()


class _StrictFormRequest(Request):
    # FastAPI reads a route's Form and File parameters through ``Request.form()``, which
    # runs this: the one place to swap the parser while keeping the parameters, their
    # validation and their OpenAPI schema.
    async def _get_form(
        self,
        *,
        max_files: int | float = 1000,
        max_fields: int | float = 1000,
        max_part_size: int = MultiPartParser.max_part_size,
    ) -> FormData:
        if self._form is None and is_multipart(self):
            try:
                self._form = await read_multipart(
                    self, max_files=max_files, max_fields=max_fields, max_part_size=max_part_size
                )
            except MultiPartException as error:
                # As Starlette answers any multipart it cannot read (400 BAD_REQUEST).
                raise HTTPException(status_code=400, detail=error.message) from None
        return await super()._get_form(
            max_files=max_files, max_fields=max_fields, max_part_size=max_part_size
        )


class StrictFormRoute(APIRoute):
    """A route whose multipart body is read strictly (the module's docstring); any other
    body is read as before."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictFormRequest(request.scope, request.receive))

        return strict

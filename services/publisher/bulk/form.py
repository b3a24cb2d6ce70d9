"""The bulk request's multipart body, read strictly.

Starlette decodes a text part that is not valid in the request's charset as Latin-1,
silently (``_user_safe_decode``): ``items`` bytes ``ff fe`` became the title "ÿþ". The
``items`` part is JSON, and JSON exchanged between systems is UTF-8 (RFC 8259, 8.1), so every
text part here must be UTF-8 whatever charset the request claims; one that is not refuses
the request (400 ``BULK_INVALID``), as does any other multipart the parser cannot read and
a ``file`` part without a filename (RFC 7578, 4.2: a file's part names its file).
"""

from __future__ import annotations

from contextlib import aclosing

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from services.runtime.errors import BadInput


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


async def read_form(request: Request, *, max_files: int, max_fields: int) -> FormData:
    """The request's parts: files as uploads, the others as UTF-8 text; BadInput
    (``BULK_INVALID``) when the body is not multipart/form-data this parser can read."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "multipart/form-data":
        raise BadInput("the request must be multipart/form-data", code="BULK_INVALID")
    try:
        async with aclosing(request.stream()) as stream:
            parser = _Utf8MultiPartParser(
                request.headers, stream, max_files=max_files, max_fields=max_fields
            )
            return await parser.parse()
    except MultiPartException as error:
        raise BadInput(error.message, code="BULK_INVALID") from None

"""A TCP proxy in front of PostgreSQL that can lose a connection right after a COMMIT landed.

Armed, it forwards the next ``COMMIT`` (a simple-protocol query, as asyncpg sends it) to the
server, reads the server's whole answer -- so the commit has happened -- and then drops the
client's connection instead of passing the answer on: the client sees its connection die
during COMMIT and cannot know the outcome. Everything else is passed through untouched.

Speaks just enough of the protocol to find message boundaries; the client must not ask for
TLS (``sslmode=disable``).
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit


class CommitDroppingProxy:
    def __init__(self, database_url: str) -> None:
        parts = urlsplit(database_url)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self._url = parts
        self._server: asyncio.Server | None = None
        self._armed = False
        self._handlers: set[asyncio.Task[None]] = set()
        self.dropped = asyncio.Event()  # set once a COMMIT landed and its client was cut off
        self.commit_tag: bytes | None = None  # the server's answer the client never saw

    async def start(self) -> str:
        """Listen on a free port; returns the database URL that goes through the proxy."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        netloc = self._url.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{port}"
        proxied = f"{netloc[0]}@{host}" if len(netloc) == 2 else host
        query = "&".join(q for q in [self._url.query, "sslmode=disable"] if q)
        return urlunsplit((self._url.scheme, proxied, self._url.path, query, ""))

    def arm(self) -> None:
        """Drop the connection of the next COMMIT, after the server answered it."""
        self._armed = True

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for handler in list(self._handlers):
            handler.cancel()
        for handler in list(self._handlers):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await handler
        if self._server is not None:
            await self._server.wait_closed()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.create_task(self._relay(reader, writer))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)

    async def _relay(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self._target)
        commit_sent = asyncio.Event()

        async def upstream() -> None:
            length = await client_reader.readexactly(4)  # the untyped startup message
            server_writer.write(length + await client_reader.readexactly(_size(length) - 4))
            while True:
                kind = await client_reader.readexactly(1)
                length = await client_reader.readexactly(4)
                body = await client_reader.readexactly(_size(length) - 4)
                if self._armed and kind == b"Q" and body.lstrip().upper().startswith(b"COMMIT"):
                    self._armed = False
                    commit_sent.set()
                server_writer.write(kind + length + body)
                await server_writer.drain()

        async def downstream() -> None:
            while True:
                kind = await server_reader.readexactly(1)
                length = await server_reader.readexactly(4)
                body = await server_reader.readexactly(_size(length) - 4)
                if not commit_sent.is_set():
                    client_writer.write(kind + length + body)
                    await client_writer.drain()
                    continue
                # The client already had every earlier answer (it waits for each one), so
                # all of this is COMMIT's: hold it back until ReadyForQuery ends it.
                if kind == b"C":
                    self.commit_tag = body.rstrip(b"\0")
                if kind == b"Z":
                    client_writer.transport.abort()
                    self.dropped.set()
                    return

        pumps = [asyncio.create_task(upstream()), asyncio.create_task(downstream())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            for pump in pumps:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pump
            client_writer.transport.abort()
            server_writer.close()


def _size(length: bytes) -> int:
    return int.from_bytes(length, "big")

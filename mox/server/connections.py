"""Limits on connections, below the routes: how long a client may take to send a request's
headers, how many connections may be open, and errors from aiohttp's HTTP parser in the
API's error shape.

aiohttp answers a request it cannot parse (a 64 KB path, a 100 KB header, TLS bytes on the
plain port) with a text/plain 400 and logs a traceback per request: a cheap way to flood the
log. `MoxRequestHandler.handle_error` answers them as JSON with the right status (414, 431,
400) and logs one line. `MoxServer` is aiohttp's protocol factory: past `max_connections`
open connections it answers 503 and closes instead of handing the socket to aiohttp.

The header timeout is aiohttp's keep-alive timer, which (since aiohttp 3.10) runs from the
moment a connection opens and from the end of each response, and closes the connection if
no whole request has arrived by then: a slowloris client that sends a header line a second
is closed at the deadline, as is an idle keep-alive connection.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from mox.server.errors import api_error
from mox.server.limits import ServerLimits

log = logging.getLogger("mox.server")

# The parser's limits. The request line may be longer than a header line, and the two must
# differ: LineTooLong carries only the limit it broke, which tells a long URL (414) from a
# long header (431).
MAX_REQUEST_LINE_BYTES = 16384
MAX_HEADER_FIELD_BYTES = 8190
MAX_HEADERS = 100
# After an error answered before the whole body came in, aiohttp keeps reading (and dropping)
# the rest for this long so the client sees the answer rather than a reset; aiohttp's 10 s
# default would let a slow-body client hold the connection ten more seconds.
LINGER_S = 1.0


def handler_args(limits: ServerLimits) -> dict[str, float | int]:
    """aiohttp's per-connection settings that carry the limits."""
    return {"keepalive_timeout": limits.header_timeout_s,
            "max_line_size": MAX_REQUEST_LINE_BYTES,
            "max_field_size": MAX_HEADER_FIELD_BYTES, "max_headers": MAX_HEADERS,
            "lingering_time": LINGER_S}


def _parser_error(exc: HttpProcessingError) -> tuple[int, str]:
    if isinstance(exc, LineTooLong):
        if exc.args[1] == MAX_REQUEST_LINE_BYTES:
            return 414, "uri_too_long"
        return 431, "request_header_fields_too_large"
    if "too many headers" in exc.message.lower():
        return 431, "request_header_fields_too_large"
    return 400, "bad_request"


class MoxRequestHandler(RequestHandler):
    """aiohttp's connection handler with JSON errors and one log line per bad request."""

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        status, code = _parser_error(exc)
        # TLS or HTTP/2 on the plain port is everyday internet noise: debug, as aiohttp does
        level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO
        log.log(level, "unparsable request from %s: %d %s", request.remote, status,
                exc.message[:200])
        text = exc.message.splitlines()[0][:200] if exc.message else code
        # the connection closes: its bytes can no longer be trusted to frame the next request
        return api_error(status, f"unparsable HTTP request: {text}", "invalid_request_error",
                         None, code, close=True).response()


class _Refuse(asyncio.Protocol):
    """A connection past the cap: one 503 and close, without reading the request."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        body = msgspec.json.encode(api_error(
            503, "too many open connections; retry shortly", "service_unavailable_error",
            None, "too_many_connections").body)
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(head.encode() + body)
        transport.close()


class MoxServer(web.Server):
    """aiohttp's protocol factory, with the connection cap and `MoxRequestHandler`."""

    max_connections: int = ServerLimits.max_connections

    def __call__(self) -> asyncio.Protocol:
        if len(self.connections) >= self.max_connections:
            log.warning("connection refused: %d open connections (the cap)",
                        len(self.connections))
            return _Refuse()
        return MoxRequestHandler(self, loop=self._loop, **self._kwargs)


class MoxRunner(web.AppRunner):
    """`web.AppRunner` whose server is a `MoxServer` capped at `max_connections`."""

    def __init__(self, app: web.Application, limits: ServerLimits, **kwargs) -> None:
        super().__init__(app, **handler_args(limits), **kwargs)
        self._max_connections = limits.max_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # the app builds a plain Server; MoxServer adds behaviour, no state of its own
        server.__class__ = MoxServer
        server.max_connections = self._max_connections
        return server

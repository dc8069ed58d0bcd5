"""The aiohttp application: routes, the API-key check, the body limit, in-flight tracking,
and the helpers that start it on a socket and stop it within the shutdown grace.

    app = create_app(backend, api_key="secret", limits=ServerLimits())
    runner, port = await start_server(app, "127.0.0.1", 8000)
    ...
    await stop_server(runner)
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from aiohttp import hdrs, web

from mox.errors import ShuttingDownError
from mox.server.backend import ServingBackend
from mox.server.connections import MoxRunner
from mox.server.errors import (
    AuthenticationError,
    Handler,
    api_error,
    error_middleware,
    http_error,
)
from mox.server.handlers import (
    CONTEXT,
    ServerContext,
    create_chat_completion,
    create_completion,
    health,
    list_models,
    metrics,
    retrieve_model,
)
from mox.server.limits import DEFAULT_LIMITS, ServerLimits
from mox.server.metrics import ServerMetrics
from mox.server.openapi import openapi_json

log = logging.getLogger("mox.server")
# probes, scrapers and clients discovering the API carry no API key
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})
# Of the shutdown grace, the time kept for ending cut requests with an error and closing.
SHUTDOWN_END_S = 2.0


def _auth_middleware(api_key: str):
    expected = api_key.encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            # (the scheme's case is free: RFC 9110 11.1)
            scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
            if not (hmac.compare_digest(given.strip().encode(), expected)    # constant time
                    and scheme.lower() == "bearer"):
                raise AuthenticationError("missing or invalid API key (Authorization: "
                                          "Bearer <key>)")
        return await handler(request)

    return check_api_key


def _oversize(request: web.Request) -> web.HTTPRequestEntityTooLarge | None:
    """The 413 for a body announced larger than the limit (None: within it, or chunked:
    aiohttp's client_max_size catches those while reading)."""
    limit = request.app[CONTEXT].limits.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return web.HTTPRequestEntityTooLarge(max_size=limit,
                                             actual_size=request.content_length)
    return None


@web.middleware
async def _limit_body(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse an announced oversize body before reading any of it."""
    if (too_large := _oversize(request)) is not None:
        raise too_large
    return await handler(request)


async def _expect_continue(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: refuse an oversize body before inviting it (aiohttp's default
    sends 100 Continue first, then reads the body only to answer 413)."""
    if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
        return api_error(417, f"unsupported Expect: {request.headers[hdrs.EXPECT][:100]}",
                         "invalid_request_error", None, "expectation_failed",
                         close=True).response()
    if (too_large := _oversize(request)) is not None:
        return http_error(too_large).response()
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None


class InFlight:
    """The requests being handled, so shutdown can wait for them; once `closing`, new ones
    are refused with 503."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.closing = False

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.closing:
            raise ShuttingDownError("mox is shutting down; retry on another server")
        self.count += 1
        self.idle.clear()
        try:
            return await handler(request)
        finally:
            self.count -= 1
            if self.count == 0:
                self.idle.set()


METRICS = web.AppKey("mox_metrics", ServerMetrics)
IN_FLIGHT = web.AppKey("mox_in_flight", InFlight)


def create_app(backend: ServingBackend, api_key: str | None = None,
               limits: ServerLimits = DEFAULT_LIMITS) -> web.Application:
    """`api_key`: when set, every route but OPEN_PATHS needs `Authorization: Bearer
    <api_key>`. `app[METRICS]` is the server's ServerMetrics."""
    in_flight = InFlight()
    middlewares = [error_middleware, in_flight.middleware, _limit_body]
    if api_key:
        middlewares.append(_auth_middleware(api_key))
    app = web.Application(middlewares=middlewares, client_max_size=limits.max_body_bytes)
    server_metrics = ServerMetrics(backend.snapshot)
    app[CONTEXT] = ServerContext(backend, server_metrics, limits)
    app[METRICS] = server_metrics
    app[IN_FLIGHT] = in_flight
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    for path, handler in (("/v1/completions", create_completion),
                          ("/v1/chat/completions", create_chat_completion)):
        app.router.add_post(path, handler, expect_handler=_expect_continue)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    return app


async def start_server(app: web.Application, host: str = "127.0.0.1",
                       port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: any free port) under its ServerLimits; returns the
    runner (`stop_server(runner)` stops it) and the bound port. Handler cancellation is on,
    so a client that disconnects while its non-streamed request runs aborts that request."""
    runner = MoxRunner(app, app[CONTEXT].limits, handler_cancellation=True,
                       shutdown_timeout=SHUTDOWN_END_S / 4, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    return runner, bound


async def stop_server(runner: web.AppRunner) -> None:
    """Stop accepting, let in-flight requests run until SHUTDOWN_END_S before the grace ends,
    then end the rest with an error (streams get an error event and [DONE]) and close."""
    app = runner.app
    in_flight, ctx = app[IN_FLIGHT], app[CONTEXT]
    in_flight.closing = True
    for site in list(runner.sites):
        await site.stop()
    wait_s = max(0.0, ctx.limits.shutdown_grace_s - SHUTDOWN_END_S)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(in_flight.idle.wait(), wait_s)
    if in_flight.count:
        log.warning("shutdown grace over: ending %d requests", in_flight.count)
        ctx.backend.abort_all(ShuttingDownError("mox is shutting down; the request was cut "
                                                "after the shutdown grace"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(in_flight.idle.wait(), SHUTDOWN_END_S / 2)
    await runner.cleanup()

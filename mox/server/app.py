"""The aiohttp application: routes, the API-key check, the body limit, and a helper that
starts it on a socket.

    app = create_app(backend, api_key="secret")
    runner, port = await start_server(app, "127.0.0.1", 8000)
    ...
    await runner.cleanup()
"""

from __future__ import annotations

import hmac

from aiohttp import web

from mox.server.backend import ServingBackend
from mox.server.errors import AuthenticationError, Handler, error_middleware
from mox.server.handlers import (
    CONTEXT,
    ServerContext,
    create_chat_completion,
    create_completion,
    health,
    list_models,
    metrics,
)
from mox.server.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 1 << 20      # a 4k-token prompt as ids is ~30 KB of JSON
OPEN_PATHS = frozenset({"/health", "/metrics"})   # probes and scrapers carry no API key
SHUTDOWN_GRACE_S = 10.0               # in-flight requests get this long on cleanup()


def _auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):      # constant time
                raise AuthenticationError("missing or invalid API key (Authorization: "
                                          "Bearer <key>)")
        return await handler(request)

    return check_api_key


@web.middleware
async def _limit_body(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse an announced oversize body before reading any of it (aiohttp's own
    client_max_size catches chunked ones while reading)."""
    limit = request.app[MAX_BODY_BYTES]
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit,
                                            actual_size=request.content_length)
    return await handler(request)


MAX_BODY_BYTES = web.AppKey("mox_max_body_bytes", int)
METRICS = web.AppKey("mox_metrics", ServerMetrics)


def create_app(backend: ServingBackend, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    """`api_key`: when set, every route but /health and /metrics needs
    `Authorization: Bearer <api_key>`. `app[METRICS]` is the server's ServerMetrics."""
    middlewares = [error_middleware, _limit_body]
    if api_key:
        middlewares.append(_auth_middleware(api_key))
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    server_metrics = ServerMetrics(backend.snapshot)
    app[CONTEXT] = ServerContext(backend, server_metrics)
    app[METRICS] = server_metrics
    app[MAX_BODY_BYTES] = max_body_bytes
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start_server(app: web.Application, host: str = "127.0.0.1",
                       port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: any free port); returns the runner (`await
    runner.cleanup()` stops it) and the bound port. Handler cancellation is on, so a client
    that disconnects while its non-streamed request runs aborts that request too."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    return runner, bound

"""Exceptions -> OpenAI error bodies `{"error": {"message", "type", "param", "code"}}` and HTTP
statuses, in one table; and the middleware that applies it to every response, aiohttp's own
404/405/413 included, so no client ever sees an error in another shape."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from mox.errors import (
    AdmissionError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelUnavailableError,
    MoxError,
    RequestTimeoutError,
    ShuttingDownError,
)
from mox.sampling import NaNLogitsError
from mox.server.responses import ErrorBody, ErrorDetail

log = logging.getLogger("mox.server")

MIN_RETRY_AFTER_S = 1      # Retry-After is whole seconds; 0 would invite a retry storm


class AuthenticationError(MoxError):
    """Missing or wrong API key (401)."""


class NotReadyError(MoxError):
    """The backend does not accept requests yet (503 from /health)."""


class RequestAbortedError(MoxError):
    """The backend ended the request without a reason (e.g. shutting down): 503."""


class BodyTimeoutError(MoxError):
    """The client did not send its whole body within the body timeout (408)."""


class EngineFailureError(MoxError):
    """The backend ended the request because serving it failed (e.g. a checkpoint file
    vanished); the message is mox's own, so it is shown: 500."""


@dataclass(frozen=True)
class HttpError:
    status: int
    body: ErrorBody
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False          # end the connection after this answer

    def response(self) -> web.Response:
        response = web.Response(status=self.status, body=msgspec.json.encode(self.body),
                                content_type="application/json", headers=self.headers)
        if self.close:
            response.force_close()
        return response


def api_error(status: int, message: str, type_: str, param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None,
           close: bool = False) -> HttpError:
    return HttpError(status, ErrorBody(ErrorDetail(message, type_, param, code)), headers or {},
                     close)


def http_error(exc: BaseException) -> HttpError:
    """The one mapping. Unknown exceptions are bugs: logged with their traceback, answered
    with a generic 500 that leaks nothing."""
    if isinstance(exc, InvalidRequestError):
        return api_error(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, ModelNotFoundError):
        return api_error(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, AuthenticationError):
        return api_error(401, str(exc), "invalid_request_error", None, "invalid_api_key",
                         {"WWW-Authenticate": "Bearer"})
    if isinstance(exc, AdmissionError):
        retry_after = max(MIN_RETRY_AFTER_S, math.ceil(exc.retry_after_s))
        return api_error(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded",
                      {"Retry-After": str(retry_after)})
    if isinstance(exc, BodyTimeoutError):
        return api_error(408, str(exc), "invalid_request_error", None, "request_timeout",
                      close=True)
    if isinstance(exc, ShuttingDownError):
        return api_error(503, str(exc), "service_unavailable_error", None, "shutting_down",
                      close=True)
    if isinstance(exc, ModelUnavailableError | NotReadyError | RequestAbortedError):
        return api_error(503, str(exc), "service_unavailable_error", None, "service_unavailable")
    if isinstance(exc, RequestTimeoutError):
        return api_error(503, str(exc), "service_unavailable_error", None, "request_timeout")
    if isinstance(exc, EngineFailureError):
        return api_error(500, str(exc), "server_error", None, "internal_error")
    if isinstance(exc, NaNLogitsError):        # a known fault of the model, not a bug of mox
        return api_error(500, str(exc), "server_error", None, "nan_logits")
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return api_error(413, f"request body too large: {exc.text}", "invalid_request_error",
                      None, "request_too_large")
    if isinstance(exc, web.HTTPException) and exc.status >= 400:
        return api_error(exc.status, exc.reason, "invalid_request_error", None,
                      exc.reason.lower().replace(" ", "_"))
    log.error("internal error", exc_info=exc)
    return api_error(500, "internal server error", "server_error", None, "internal_error")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error = http_error(e)
        if isinstance(e, web.HTTPMethodNotAllowed | web.HTTPNotFound):
            error = api_error(e.status, f"{e.reason}: {request.method} {request.path}",
                           "invalid_request_error", None, e.reason.lower().replace(" ", "_"))
        return error.response()
    except Exception as e:  # noqa: BLE001 - the one place every error becomes an answer
        return http_error(e).response()

"""The fleet's HTTP ingress: Ray's proxy hands it each request; it reads the body's `model`
and forwards the request unchanged to a replica chosen for that model (the handle's
multiplexed model id; mox.fleet.routing ranks the replicas). Everything OpenAI-shaped (the
checks, errors, API key, streaming) is the replica's mox server's, so there is one
implementation of the API.

Faults: a replica that dies during a request that is not streamed is retried once (Ray
routes the retry to a live replica); a stream cut by a dead replica ends with an error event
and [DONE], as the mox server ends a stream that fails. `/metrics` merges every replica's
metrics under a `replica` label; `/fleet` lists the replicas' reports as JSON.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from mox.fleet.directory import directory, merge_metrics
from mox.fleet.messages import (
    REPLICA_HEADER,
    Exchange,
    ResponseHead,
    end_to_end,
    request_fields,
)
from mox.fleet.warmth import fleet_model_states
from mox.server.errors import api_error
from mox.server.sse import DONE, sse_event

log = logging.getLogger("mox.fleet")
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# A replica that died (RayActorError) or whose forwarding failed as it stopped (RayTaskError
# wrapping the connection error)
REPLICA_LOST = (RayActorError, RayTaskError)


def _lost(e: BaseException):
    return api_error(503, f"the replica serving this request stopped ({type(e).__name__}); "
                     "the output is cut: retry", "server_error", code="replica_unavailable")


def _replica_gone(e: BaseException) -> Response:
    return Response(msgspec.json.encode(_lost(e).body), status_code=503,
                    media_type="application/json")


class MoxIngress:
    def __init__(self, replicas: DeploymentHandle, app_name: str) -> None:
        self._replicas = replicas
        self._directory = directory(app_name)

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET" and request.url.path == "/metrics":
            reports = await self._directory.reports.remote()
            body = merge_metrics({r: rep["metrics"] for r, rep in reports.items()})
            return Response(body, media_type=PROMETHEUS_TEXT)
        if request.method == "GET" and request.url.path == "/fleet":
            reports = await self._directory.reports.remote()
            return Response(msgspec.json.encode(
                {r: {k: v for k, v in rep.items() if k != "metrics"}
                 for r, rep in reports.items()}), media_type="application/json")
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        exchange = Exchange(request.method, path, end_to_end(request.headers.items()), body)
        fields = request_fields(body) if request.method == "POST" else None
        model = fields.model if fields else ""
        if fields is not None and fields.stream:
            return await self._stream(exchange, model)
        if request.method == "GET" and request.url.path.startswith("/v1/models"):
            return await self._models(exchange)
        return await self._whole(exchange, model)

    async def _models(self, exchange: Exchange) -> Response:
        """A replica's model list (its API key check, its 404s), each state the fleet's."""
        response = await self._whole(exchange, "")
        if response.status_code != 200:
            return response
        reports = await self._directory.reports.remote()
        headers = {k: v for k, v in response.headers.items() if k.lower() == REPLICA_HEADER}
        return Response(fleet_model_states(response.body, reports), headers=headers,
                        media_type="application/json")

    def _send(self, exchange: Exchange, model: str) -> DeploymentResponseGenerator:
        return self._replicas.options(stream=True, multiplexed_model_id=model).forward.remote(
            exchange)

    async def _whole(self, exchange: Exchange, model: str) -> Response:
        """The replica's whole response; tried once more if its replica is lost (nothing of
        it reached the client yet)."""
        for attempt in (1, 2):
            try:
                head, *chunks = [c async for c in self._send(exchange, model)]
                return Response(b"".join(chunks), status_code=head.status,
                                headers=dict(head.headers))
            except REPLICA_LOST as e:
                log.warning("replica lost serving %s %s (attempt %d): %s", exchange.method,
                            exchange.path, attempt, e)
                lost = e
        return _replica_gone(lost)

    async def _stream(self, exchange: Exchange, model: str) -> Response:
        responses = self._send(exchange, model)
        try:
            head: ResponseHead = await responses.__anext__()
            if head.status != 200:       # an error before the stream began: plain JSON
                body = b"".join([c async for c in responses])
                return Response(body, status_code=head.status, headers=dict(head.headers))
        except REPLICA_LOST as e:
            return _replica_gone(e)
        return StreamingResponse(_events(responses), status_code=200,
                                 headers=dict(head.headers))


async def _events(responses: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The stream's chunks; a replica that dies mid-stream ends it with an error event and
    [DONE]. A client that goes away cancels this, which cancels the replica's generation."""
    ended = False
    try:
        async for chunk in responses:
            yield chunk
        ended = True
    except REPLICA_LOST as e:
        ended = True
        log.warning("replica lost mid-stream: %s", e)
        yield sse_event(_lost(e).body)
        yield DONE
    finally:
        if not ended:     # (cancelling an ended stream leaves a future whose error no one reads)
            responses.cancel()


"""The OpenAPI 3.1 description of mox's HTTP API, served at `GET /openapi.json`.

Every request and response body schema is generated from the msgspec Structs the handlers
decode and encode (`protocol.py`, `responses.py`), so the description cannot drift from the
code; only routes, statuses and prose are written here. The document is immutable, so it is
built once and its encoded bytes are reused.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

import msgspec
from aiohttp import web

from mox.server.protocol import ChatCompletionRequest, CompletionRequest
from mox.server.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ErrorBody,
    ModelList,
)

OPENAPI_VERSION = "3.1.0"
REF_TEMPLATE = "#/components/schemas/{name}"
UNKNOWN_VERSION = "0"          # running from a checkout that was never installed
BEARER = "bearerAuth"
# The Structs whose schemas the document references; their dependencies come along.
DOCUMENTED_TYPES = (CompletionRequest, ChatCompletionRequest, Completion, ChatCompletion,
                    ChatCompletionChunk, ModelList, ErrorBody)

# Every error is an ErrorBody; these say when each status happens.
ERROR_STATUSES = {
    400: "Malformed JSON, a wrong type, or a parameter out of range or unsupported "
         "(`param` names it); or a request the HTTP parser refused.",
    401: "Missing or wrong API key (only when the server was started with one).",
    404: "Unknown model (`code: model_not_found`) or route.",
    408: "The request's headers or body were not received in time.",
    413: "The request body is larger than the server's limit.",
    414: "The request line (the URL) is too long.",
    417: "An `Expect` header other than `100-continue`.",
    429: "Admission refused: the model's queue is full; retry after `Retry-After` seconds.",
    431: "A header too large, or too many headers.",
    503: "Not ready, the model is unavailable (failed or loading), shutting down, or too many "
         "open connections.",
    500: "A bug or an engine failure; the message names no internals.",
}
# What any route can answer: the HTTP parser, the read timeouts, the connection cap and
# shutdown act before routing, and a bug can happen anywhere.
ANY_ROUTE_ERRORS = (400, 408, 414, 431, 503, 500)
GENERATION_ERRORS = tuple(ERROR_STATUSES)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(name=name)}


def _error_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {"description": ERROR_STATUSES[status],
                                "content": {"application/json": {"schema": _ref("ErrorBody")}}}
    if status == 429:
        response["headers"] = {"Retry-After": {
            "description": "Whole seconds to wait before retrying.",
            "schema": {"type": "integer", "minimum": 1}}}
    return response


def _errors(statuses: tuple[int, ...]) -> dict[str, Any]:
    return {str(s): {"$ref": f"#/components/responses/Error{s}"} for s in statuses}


def _generation(operation_id: str, summary: str, request: str, response: str,
                chunk: str) -> dict[str, Any]:
    """A POST that answers JSON, or with `stream: true` Server-Sent Events whose data are
    chunks (a failure after the first chunk is one ErrorBody event), ending `[DONE]`."""
    stream = {
        "schema": {"type": "string", "description": f"`data: <{chunk} JSON>` events, then "
                   "`data: [DONE]`; a failure mid-stream is a `data: <ErrorBody JSON>` "
                   "event before `[DONE]`."},
        # OpenAPI 3.1 cannot type an event stream's items: this extension does.
        "x-event-data": {"oneOf": [_ref(chunk), _ref("ErrorBody")]},
    }
    return {"post": {
        "operationId": operation_id, "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "The generated output.",
                              "content": {"application/json": {"schema": _ref(response)},
                                          "text/event-stream": stream}},
                      **_errors(GENERATION_ERRORS)}}}


def _open_get(operation_id: str, summary: str, content: dict[str, Any],
              errors: tuple[int, ...]) -> dict[str, Any]:
    """A GET that needs no API key (probes, scrapers, and clients discovering the API)."""
    return {"get": {"operationId": operation_id, "summary": summary, "security": [],
                    "responses": {"200": {"description": summary, "content": content},
                                  **_errors(errors)}}}


def _paths() -> dict[str, Any]:
    json_object = {"application/json": {"schema": {"type": "object"}}}
    # /health answers a literal dict, not a Struct: its one-field shape is stated here.
    health = {"application/json": {"schema": {
        "type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}}}
    return {
        "/v1/models": {"get": {
            "operationId": "listModels", "summary": "The models this server serves.",
            "responses": {"200": {"description": "The models and their states.",
                                  "content": {"application/json": {"schema": _ref("ModelList")}}},
                          **_errors((401, *ANY_ROUTE_ERRORS))}}},
        "/v1/models/{model}": {"get": {
            "operationId": "retrieveModel", "summary": "One model this server serves.",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": {"description": "The model and its state.",
                                  "content": {"application/json": {"schema": _ref("ModelCard")}}},
                          **_errors((401, 404, *ANY_ROUTE_ERRORS))}}},
        "/v1/completions": _generation("createCompletion", "Complete a prompt.",
                                       "CompletionRequest", "Completion", "Completion"),
        "/v1/chat/completions": _generation("createChatCompletion", "Answer a conversation.",
                                            "ChatCompletionRequest", "ChatCompletion",
                                            "ChatCompletionChunk"),
        "/health": _open_get("health", "Ready to serve.", health, ANY_ROUTE_ERRORS),
        "/metrics": _open_get("metrics", "Prometheus metrics.",
                              {"text/plain": {"schema": {"type": "string"}}}, ANY_ROUTE_ERRORS),
        "/openapi.json": _open_get("openapi", "This document.", json_object, ANY_ROUTE_ERRORS),
    }


def _version() -> str:
    try:
        return importlib.metadata.version("mox")
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document as a dict. Cached and shared: callers must not mutate it."""
    _, schemas = msgspec.json.schema_components(DOCUMENTED_TYPES, ref_template=REF_TEMPLATE)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "mox", "version": _version(),
                 "description": "OpenAI-compatible completions and chat completions over "
                                "mixture-of-experts models paged by expert."},
        "paths": _paths(),
        "components": {
            "schemas": schemas,
            "responses": {f"Error{s}": _error_response(s) for s in ERROR_STATUSES},
            "securitySchemes": {BEARER: {
                "type": "http", "scheme": "bearer",
                "description": "The server's --api-key (or MOX_API_KEY); required only when "
                               "one is set. /health, /metrics and /openapi.json are open."}},
        },
        "security": [{BEARER: []}],
    }


@functools.cache
def _encoded() -> bytes:
    return msgspec.json.encode(openapi_document())


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=_encoded(), content_type="application/json")

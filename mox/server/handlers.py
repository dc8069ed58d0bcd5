"""The route handlers. Each is thin: decode -> tokenize -> `Request` -> backend -> respond
(stream or collect). Every error they raise is turned into an OpenAI error body by
`errors.error_middleware`."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import msgspec
from aiohttp import web
from msgspec import UNSET

from mox.errors import InvalidRequestError, ModelNotFoundError
from mox.messages import Request
from mox.server.backend import ServingBackend
from mox.server.errors import BodyTimeoutError, NotReadyError
from mox.server.formatting import ChatFormat, CompletionFormat, OutputFormat
from mox.server.generation import Generation
from mox.server.limits import ServerLimits
from mox.server.metrics import ServerMetrics
from mox.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_sampling_params,
    completion_prompt,
    completion_sampling_params,
    decode_body,
)
from mox.server.responses import ModelCard, ModelList
from mox.server.sse import stream_sse
from mox.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServerContext:
    backend: ServingBackend
    metrics: ServerMetrics
    limits: ServerLimits


CONTEXT = web.AppKey("mox_server_context", ServerContext)


def json_response(body: msgspec.Struct) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


def _model_cards(http_request: web.Request) -> list[ModelCard]:
    return [ModelCard(info.name, info.created, info.state.value,
                      error=UNSET if info.error is None else info.error,
                      settings=UNSET if info.settings is None else info.settings)
            for info in http_request.app[CONTEXT].backend.models()]


async def list_models(http_request: web.Request) -> web.Response:
    return json_response(ModelList(_model_cards(http_request)))


async def retrieve_model(http_request: web.Request) -> web.Response:
    """`GET /v1/models/{model}`: one model's card (404 model_not_found for any other)."""
    name = http_request.match_info["model"]
    card = next((c for c in _model_cards(http_request) if c.id == name), None)
    if card is None:
        raise ModelNotFoundError(f"model {name!r} is not served; see GET /v1/models")
    return json_response(card)


async def health(http_request: web.Request) -> web.Response:
    if not http_request.app[CONTEXT].backend.is_ready():
        raise NotReadyError("mox is starting; not ready yet")
    return web.json_response({"status": "ok"})


async def metrics(http_request: web.Request) -> web.Response:
    body, content_type = http_request.app[CONTEXT].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


def _text_ids(tokenizer: Tokenizer | None, text: str, model: str, param: str,
              special_tokens: bool = True) -> list[int]:
    if tokenizer is None:
        raise InvalidRequestError(f"model {model!r} has no tokenizer; send token ids",
                                  param=param)
    return tokenizer.encode(text, special_tokens)


async def _read_body(http_request: web.Request, limits: ServerLimits) -> bytes:
    """The whole body, within the body timeout (a client sending a byte a second must not
    hold a connection for ever)."""
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            return await http_request.read()
    except TimeoutError:
        raise BodyTimeoutError(f"the request body did not arrive within "
                               f"{limits.body_timeout_s:g} s") from None


async def create_completion(http_request: web.Request) -> web.StreamResponse:
    ctx = http_request.app[CONTEXT]
    body = decode_body(await _read_body(http_request, ctx.limits), CompletionRequest)
    params = completion_sampling_params(body, ctx.limits,
                                        ctx.backend.sampling_defaults(body.model))
    tokenizer = ctx.backend.tokenizer(body.model)
    prompt = completion_prompt(body.prompt)
    prompt_ids = (prompt if isinstance(prompt, list)
                  else _text_ids(tokenizer, prompt, body.model, "prompt"))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    fmt = CompletionFormat(request_id, body.model, tokenizer)
    return await _respond(http_request, ctx, Request(request_id, body.model, prompt_ids, params),
                          fmt, body.stream, body.include_usage)


async def create_chat_completion(http_request: web.Request) -> web.StreamResponse:
    ctx = http_request.app[CONTEXT]
    body = decode_body(await _read_body(http_request, ctx.limits), ChatCompletionRequest)
    params = chat_sampling_params(body, ctx.limits, ctx.backend.sampling_defaults(body.model))
    tokenizer = ctx.backend.tokenizer(body.model)
    messages = [m.as_template_input() for m in body.messages]
    _refuse_control_tokens(messages, tokenizer)
    text = ctx.backend.chat_template(body.model).render(messages)
    prompt_ids = _text_ids(tokenizer, text, body.model, "messages", special_tokens=False)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    fmt = ChatFormat(request_id, body.model, tokenizer)
    try:
        return await _respond(http_request, ctx,
                              Request(request_id, body.model, prompt_ids, params), fmt,
                              body.stream, body.include_usage)
    except InvalidRequestError as e:
        if e.param == "prompt":              # a chat's prompt is its rendered messages
            e.param = "messages"
        raise


def _refuse_control_tokens(messages: list[dict[str, str]], tokenizer: Tokenizer | None) -> None:
    """A message's text holding a control token's text (`<|im_end|>`...) would become that
    token once the rendered chat is encoded: a user could end their turn and write a system
    one. OpenAI reads such text as text; mox, which encodes the chat whole, refuses it."""
    if tokenizer is None:
        return
    for i, message in enumerate(messages):
        for field, text in message.items():          # content, and a name
            found = tokenizer.control_text(text)
            if found is not None:
                raise InvalidRequestError(f"messages[{i}].{field} holds the model's control "
                                          f"token text {found!r}",
                                          param=f"messages[{i}].{field}")


async def _respond(http_request: web.Request, ctx: ServerContext, request: Request,
                   fmt: OutputFormat, stream: bool, include_usage: bool) -> web.StreamResponse:
    generation = Generation(ctx.backend, request, ctx.metrics)
    if stream:
        return await stream_sse(http_request, generation, fmt, include_usage)
    result = await generation.collect()
    return json_response(fmt.response(result, generation.usage))

"""OpenAI request bodies as msgspec Structs, their decoding, and their sampling parameters.

Unknown fields are ignored (msgspec's default), as OpenAI clients expect. Known OpenAI
parameters that mox cannot honour are refused with a 400 naming the parameter, never
silently dropped. `top_k`, `ignore_eos` and `stop_token_ids` are vLLM's extensions; vLLM's
other sampling extensions are refused unless they are at their defaults (a client that sets
them expects them to work).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Literal, TypeVar

import msgspec

from mox.errors import InvalidRequestError
from mox.messages import MAX_MODEL_NAME
from mox.sampling import SamplingParams, with_model_defaults
from mox.server.limits import DEFAULT_LIMITS, ServerLimits

DEFAULT_COMPLETION_MAX_TOKENS = 16      # OpenAI's documented default for /v1/completions
MAX_TEMPERATURE = 2.0                   # OpenAI's range is [0, 2]
EMPTY: Mapping[str, float | int] = MappingProxyType({})      # no model defaults
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MODEL_NAME)]

T = TypeVar("T")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """The fields both endpoints share."""

    model: ModelName
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None                       # accepted and ignored, as OpenAI does
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # vLLM's extensions mox does not implement: refused unless at these (vLLM's) defaults
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    use_beam_search: bool = False
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields, kw_only=True):
    # a string, token ids, or a batch of one of either
    prompt: str | list[int | str | list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    # (tool and function messages, and an assistant's tool_calls, need tools: refused)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None

    def as_template_input(self) -> dict[str, str]:
        """The message as chat templates expect it: text content (parts joined by lines)."""
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise InvalidRequestError("only text content parts are supported",
                                          param="messages")
            if any(p.text is None for p in self.content):
                raise InvalidRequestError("a text content part needs its `text`",
                                          param="messages")
            content = "\n".join(p.text for p in self.content)
        else:
            content = self.content or ""
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(msgspec.Struct):
    type: str = "text"


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: ResponseFormat | None = None
    # vLLM's chat-template extensions: refused unless at these defaults, as above
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None


_AT_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING_FIELD = re.compile(r"missing required field `(?P<field>[^`]+)`")


def decode_body(body: bytes, kind: type[T]) -> T:
    """JSON bytes -> `kind`; malformed JSON and wrong types raise InvalidRequestError whose
    `param` is the offending field's path (e.g. `temperature`, `messages[0].content`)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        message = str(e)
        at = _AT_PATH.search(message)
        path = at.group("path") if at else ""
        missing = _MISSING_FIELD.search(message)
        if missing:
            path = f"{path}.{missing.group('field')}" if path else missing.group("field")
        raise InvalidRequestError(f"invalid request body: {message}", param=path or None) from e
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"malformed JSON body: {e}") from e
    except RecursionError:      # msgspec's decoder recurses once per nesting level
        raise InvalidRequestError("malformed JSON body: nested too deeply") from None


def _require(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise InvalidRequestError(message, param=param)


def _check_common(body: _SamplingFields, max_tokens: int | None, max_tokens_param: str,
                  limits: ServerLimits) -> None:
    _require(body.n in (None, 1), f"n must be 1 (got {body.n}); send one request per choice",
             "n")
    _require(max_tokens is None or 1 <= max_tokens <= limits.max_tokens_cap,
             f"{max_tokens_param} must be in [1, {limits.max_tokens_cap}] (the server's cap), "
             f"got {max_tokens}", max_tokens_param)
    t = body.temperature
    _require(t is None or 0.0 <= t <= MAX_TEMPERATURE,
             f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}", "temperature")
    _require(body.top_p is None or 0.0 < body.top_p <= 1.0,
             f"top_p must be in (0, 1], got {body.top_p}", "top_p")
    _require(body.top_k is None or body.top_k == -1 or body.top_k >= 1,
             f"top_k must be -1 (off) or at least 1, got {body.top_k}", "top_k")
    _require(body.stream or body.stream_options is None,
             "stream_options is only allowed with stream=true", "stream_options")
    for name in ("presence_penalty", "frequency_penalty"):
        _require(not getattr(body, name), f"{name} is not supported", name)
    _require(not body.logit_bias, "logit_bias is not supported", "logit_bias")
    _require_defaults(body, _VLLM_DEFAULTS)


def _require_defaults(body: msgspec.Struct, defaults: dict[str, object]) -> None:
    for name, default in defaults.items():
        value = getattr(body, name)
        _require(value is None or value == default,
                 f"{name} is not supported (only its default, {default!r})", name)


# vLLM's sampling extensions mox does not implement, with the values that leave them off
_VLLM_DEFAULTS = {"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0,
                  "use_beam_search": False, "include_stop_str_in_output": False,
                  "prompt_logprobs": None, "guided_json": None, "guided_regex": None,
                  "guided_choice": None, "guided_grammar": None,
                  "truncate_prompt_tokens": None, "skip_special_tokens": True}
_VLLM_CHAT_DEFAULTS = {"add_generation_prompt": True, "continue_final_message": False,
                       "chat_template_kwargs": None, "documents": None}


def _params(body: _SamplingFields, max_tokens: int, logprobs: bool,
            max_tokens_param: str | None, defaults: Mapping[str, float | int]
            ) -> SamplingParams:
    """`defaults`: the model's (ServingBackend.sampling_defaults) for what the body omits."""
    return SamplingParams(
        max_tokens=max_tokens, max_tokens_param=max_tokens_param,
        **with_model_defaults(defaults, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k),
        seed=body.seed, stop=() if body.stop is None else body.stop,
        stop_token_ids=body.stop_token_ids or (),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs)


def completion_sampling_params(body: CompletionRequest,
                               limits: ServerLimits = DEFAULT_LIMITS,
                               defaults: Mapping[str, float | int] = EMPTY) -> SamplingParams:
    """Range checks (400 naming the parameter), then SamplingParams. `logprobs`: only the
    chosen token's log-probability is reported, so only `logprobs=0` is accepted."""
    _check_common(body, body.max_tokens, "max_tokens", limits)
    _require(body.logprobs in (None, 0), "only logprobs=0 (the chosen token's log-probability)"
             " is supported; top alternatives are not", "logprobs")
    _require(not body.echo, "echo is not supported", "echo")
    _require(body.best_of in (None, 1), "best_of must be 1", "best_of")
    _require(body.suffix is None, "suffix is not supported", "suffix")
    max_tokens = (min(DEFAULT_COMPLETION_MAX_TOKENS, limits.max_tokens_cap)
                  if body.max_tokens is None else body.max_tokens)
    return _params(body, max_tokens, logprobs=body.logprobs is not None,
                   max_tokens_param=None if body.max_tokens is None else "max_tokens",
                   defaults=defaults)


def chat_sampling_params(body: ChatCompletionRequest,
                         limits: ServerLimits = DEFAULT_LIMITS,
                         defaults: Mapping[str, float | int] = EMPTY) -> SamplingParams:
    """As completions; `max_completion_tokens` wins over the older `max_tokens`; without
    either, the server's `default_max_tokens` (a request without a limit must not be a
    lever for running every sequence to the context's end)."""
    limit_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    limit = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    _check_common(body, limit, limit_param, limits)
    _require(not body.top_logprobs, "top_logprobs is not supported; logprobs=true reports the "
             "chosen token's log-probability", "top_logprobs")
    _require(not body.tools, "tools are not supported", "tools")
    _require_defaults(body, _VLLM_CHAT_DEFAULTS)
    _require(body.tool_choice in (None, "none"), "tool_choice is not supported (tools are "
             "not)", "tool_choice")
    for i, message in enumerate(body.messages):
        _require(not message.tool_calls, "tool calls are not supported (tools are not)",
                 f"messages[{i}].tool_calls")
    _require(body.response_format is None or body.response_format.type == "text",
             "only response_format type 'text' is supported", "response_format")
    _require(len(body.messages) > 0, "messages must not be empty", "messages")
    return _params(body, limits.default_max_tokens if limit is None else limit,
                   bool(body.logprobs), max_tokens_param=None if limit is None else limit_param,
                   defaults=defaults)


def completion_prompt(prompt: str | list[int | str | list[int]]) -> str | list[int]:
    """The one prompt of a completion request: text or token ids (batches of more than one
    prompt are refused: send one request per prompt)."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    _require(len(prompt) == 1, "prompt must be one string or one list of token ids "
             "(batched prompts are not supported)", "prompt")
    only = prompt[0]
    _require(not isinstance(only, int) and bool(only), "prompt must not be empty", "prompt")
    return only

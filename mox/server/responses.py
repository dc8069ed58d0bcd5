"""OpenAI response bodies as msgspec Structs: completions, chat completions, their streamed
chunks, usage, and the model list. Optional fields are UNSET (left out of the JSON) rather
than null where OpenAI leaves them out; `finish_reason` and `logprobs` are always present."""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from mox.messages import ModelSettings


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int]
    top_logprobs: None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    """Both the whole response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | UnsetType = UNSET


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class AssistantMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class Delta(msgspec.Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | UnsetType = UNSET


class ModelCard(msgspec.Struct):
    id: str
    created: int
    state: str                      # mox's addition: cold | loading | warm | failed
    object: str = "model"
    owned_by: str = "mox"
    error: str | UnsetType = UNSET  # why a failed model failed
    settings: ModelSettings | UnsetType = UNSET   # mox's: pin, priority, keep-alive


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail

"""Engine outputs -> OpenAI response objects, one formatter per endpoint. A formatter makes the
streamed chunks, the final usage chunk and the whole (non-streamed) response, so the SSE
writer and the handlers stay endpoint-agnostic."""

from __future__ import annotations

import codecs
import time
from typing import Protocol

import msgspec

from mox.messages import FinishReason, RequestOutput
from mox.server.generation import Collected
from mox.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    TokenLogprob,
    Usage,
)
from mox.tokenizer import Tokenizer


class OutputFormat(Protocol):
    def chunk(self, out: RequestOutput) -> msgspec.Struct: ...

    def usage_chunk(self, usage: Usage) -> msgspec.Struct: ...

    def response(self, result: Collected, usage: Usage) -> msgspec.Struct: ...


def _reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


class _TokenText:
    """Each token's own text and bytes, for logprobs (`token_id:N` without a tokenizer, as
    vLLM). A token holding part of a character decodes alone to U+FFFD; its bytes are its
    own."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return self(token_id).encode()
        return self.tokenizer.token_bytes(token_id)


class CompletionFormat:
    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer | None) -> None:
        self.request_id, self.model = request_id, model
        self.created = int(time.time())
        self.token_text = _TokenText(tokenizer)
        self._text_offset = 0
        # characters of the text before each token: its bytes decoded as they come (a
        # character split over tokens counts once, at the token that completes it)
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _logprobs(self, token_ids: list[int], logprobs: list[float] | None
                  ) -> CompletionLogprobs | None:
        if not logprobs:
            return None
        offsets = []
        for token_id in token_ids:
            offsets.append(self._text_offset)
            self._text_offset += len(self._text.decode(self.token_text.bytes(token_id)))
        return CompletionLogprobs([self.token_text(t) for t in token_ids], list(logprobs),
                                  offsets)

    def _completion(self, choices: list[CompletionChoice], **usage) -> Completion:
        return Completion(self.request_id, self.created, self.model, choices, **usage)

    def chunk(self, out: RequestOutput) -> Completion:
        logprobs = self._logprobs(out.new_token_ids, out.logprobs)
        return self._completion([CompletionChoice(0, out.text_delta, logprobs,
                                                  _reason(out.finish_reason))])

    def usage_chunk(self, usage: Usage) -> Completion:
        return self._completion([], usage=usage)

    def response(self, result: Collected, usage: Usage) -> Completion:
        logprobs = self._logprobs(result.token_ids, result.logprobs)
        return self._completion([CompletionChoice(0, result.text, logprobs,
                                                  _reason(result.finish_reason))], usage=usage)


class ChatFormat:
    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer | None) -> None:
        self.request_id, self.model = request_id, model
        self.created = int(time.time())
        self.token_text = _TokenText(tokenizer)
        self._sent_role = False

    def _logprobs(self, token_ids: list[int], logprobs: list[float] | None
                  ) -> ChatLogprobs | None:
        if not logprobs:
            return None
        return ChatLogprobs([TokenLogprob(self.token_text(t), lp, list(self.token_text.bytes(t)))
                             for t, lp in zip(token_ids, logprobs)])

    def chunk(self, out: RequestOutput) -> ChatCompletionChunk:
        # the first chunk names the role, as OpenAI's do
        delta = Delta(content=out.text_delta) if self._sent_role else Delta(
            role="assistant", content=out.text_delta)
        self._sent_role = True
        choice = ChatChunkChoice(0, delta, self._logprobs(out.new_token_ids, out.logprobs),
                                 _reason(out.finish_reason))
        return ChatCompletionChunk(self.request_id, self.created, self.model, [choice])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.request_id, self.created, self.model, [], usage=usage)

    def response(self, result: Collected, usage: Usage) -> ChatCompletion:
        choice = ChatChoice(0, AssistantMessage(result.text),
                            self._logprobs(result.token_ids, result.logprobs),
                            _reason(result.finish_reason))
        return ChatCompletion(self.request_id, self.created, self.model, [choice], usage)

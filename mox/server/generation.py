"""One request's run through the backend: its outputs, its token counts (usage) and its
timings (metrics). Streaming and non-streaming responses both read it.

Invariant: the backend's generator is closed (`aclose`) however the run ends, so a client
that goes away, a cancelled handler or an error always aborts the request in the engine.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from mox.messages import FinishReason, Request, RequestOutput
from mox.server.backend import ServingBackend
from mox.server.errors import EngineFailureError, RequestAbortedError
from mox.server.metrics import ServerMetrics
from mox.server.responses import Usage


@dataclass
class Collected:
    """A whole (non-streamed) result."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class Generation:
    def __init__(self, backend: ServingBackend, request: Request,
                 metrics: ServerMetrics) -> None:
        self.backend = backend
        self.request = request
        self.metrics = metrics
        self.num_generated_tokens = 0
        self._start = time.monotonic()
        self._token_times: list[float] = []     # arrival of each output that carried tokens
        self._observed = False                  # its finish is in the metrics

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_generated_tokens,
                     self.num_prompt_tokens + self.num_generated_tokens)

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        """The backend's outputs; an aborted request raises instead of ending quietly."""
        stream = self.backend.generate(self.request)
        try:
            async for out in stream:
                if out.finish_reason is FinishReason.ABORT:
                    if out.error:
                        raise EngineFailureError(out.error)
                    raise RequestAbortedError("the request was aborted by the server")
                if out.new_token_ids:
                    self.num_generated_tokens += len(out.new_token_ids)
                    self._token_times.append(time.monotonic())
                if out.finish_reason is not None:
                    self._observe(out.finish_reason)
                    yield out
                    return
                yield out
            raise RequestAbortedError("the backend ended the request without finishing it")
        finally:
            await stream.aclose()     # aborts the request unless it finished
            if not self._observed:    # cut short (a disconnect, an abort): its tokens count
                self.metrics.count_tokens(
                    self.request.model, self.num_prompt_tokens if self._token_times else 0,
                    self.num_generated_tokens)

    async def collect(self) -> Collected:
        result = Collected()
        outputs = self.outputs()
        try:
            async for out in outputs:
                result.text += out.text_delta
                result.token_ids += out.new_token_ids
                result.logprobs += out.logprobs or []
                result.finish_reason = out.finish_reason
        finally:
            await outputs.aclose()
        return result

    def _observe(self, reason: FinishReason) -> None:
        self._observed = True
        times = self._token_times
        ttft = (times[0] if times else time.monotonic()) - self._start
        itls = [b - a for a, b in zip(times, times[1:])]
        self.metrics.observe_request(self.request.model, self.num_prompt_tokens, ttft, itls,
                                     time.monotonic() - self._start,
                                     self.num_generated_tokens, reason.value)

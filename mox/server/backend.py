"""What the HTTP layer needs from whatever serves the models (the router, or one engine).

The server knows nothing below this interface: it asks for a model's tokenizer and chat
template, hands over a tokenized `Request`, and streams the `RequestOutput`s back. All methods
except `generate` are called on the server's event loop and must not block for long (no model
loading inside them: a model that is not loaded yet is reported as cold or loading, and
`generate` waits for it).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Protocol

from mox.messages import ModelSettings, ModelState, Request, RequestOutput
from mox.server.chat_template import ChatTemplate
from mox.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """One entry of `/v1/models`. `created`: unix seconds (when the model was registered)."""

    name: str
    state: ModelState
    created: int
    error: str | None = None
    settings: ModelSettings | None = None     # the operator's (None: the backend has none)


class ServingBackend(Protocol):
    """The server's only dependency.

    - `is_ready()`: True once the backend accepts requests (`/health` answers 503 until then).
    - `models()`: every served model, failed ones included.
    - `tokenizer(model)`: the model's tokenizer, or None if its checkpoint has none (then
      only token-id prompts work). Raises `ModelNotFoundError` for an unknown name and
      `ModelUnavailableError` for a model that failed to load.
    - `chat_template(model)`: the model's `ChatTemplate` (see `ChatTemplate.from_checkpoint`);
      the same errors.
    - `sampling_defaults(model)`: the `temperature` / `top_p` / `top_k` a request that gives
      none samples with (its checkpoint's generation_config.json, as vLLM applies it; empty:
      the server's defaults); the same errors.
    - `generate(request)`: an async generator of incremental outputs, the last one with a
      `finish_reason`. It may raise `InvalidRequestError` (e.g. a prompt longer than the
      context), `ModelNotFoundError`, `AdmissionError`, `ModelUnavailableError` or
      `RequestTimeoutError`, before or while yielding. Closing it (`aclose()`) before it
      finishes aborts the request and frees its KV; the server always closes it. An output
      with finish_reason ABORT ends the request as failed (`error` says why, if known).
    - `abort_all(error)`: end every running request, its `generate` raising `error`
      (shutdown past its grace). Returns at once; the ends arrive through `generate`.
    - `snapshot()`: the state `/metrics` reports at scrape time:
        {"models": {name: {"state": "warm", "running": 1, "waiting": 0, "request_rate": 0.5,
                           "dense_resident": True, "planned_slots": 10,
                           "pager": {"hits", "misses", "bytes_read", "resident_bytes",
                                     "num_slots", "held_slots", "evictions", "read_seconds",
                                     "page_in_buckets", "page_in_counts"}}},
         "device_budget_bytes": int | None, "device_used_bytes": int}
      A cold model also has "cold_start": how a request for it would start now,
      {"waits": bool (for a busy model's turn), "parks": [idle models it would park],
       "squeezes": {idle model: share of its expert pool the start would take}}.
      Any per-model key may be missing (a cold model has no "pager"); what is missing is not
      reported. Called from the scrape handler on the event loop, while the engine steps on
      its own thread: it must be cheap and safe to call from there.
    """

    def is_ready(self) -> bool: ...

    def models(self) -> list[ModelInfo]: ...

    def tokenizer(self, model: str) -> Tokenizer | None: ...

    def chat_template(self, model: str) -> ChatTemplate: ...

    def sampling_defaults(self, model: str) -> Mapping[str, float | int]: ...

    def generate(self, request: Request) -> AsyncGenerator[RequestOutput, None]: ...

    def abort_all(self, error: Exception) -> None: ...

    def snapshot(self) -> dict: ...

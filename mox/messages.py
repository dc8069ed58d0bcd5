"""The messages that cross layers: a request going in, the outputs coming back, why a request
finished, and a model's serving state. The server, the router and the engine all speak these;
nothing here depends on any of them.
"""

from __future__ import annotations

import enum

import msgspec

from mox.sampling import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"        # an eos / stop token or a stop string
    LENGTH = "length"    # max_tokens or the model's context
    ABORT = "abort"      # cancelled by the client, or failed


class Request(msgspec.Struct, omit_defaults=True):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams


class RequestOutput(msgspec.Struct, omit_defaults=True, gc=False):
    """Incremental: the tokens and text this step added; `finish_reason` once finished."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[float] | None = None
    error: str | None = None


class ModelState(str, enum.Enum):
    COLD = "cold"          # no weights on the device; requests wait while it loads
    LOADING = "loading"    # dense weights (model-swap: the whole model) being read
    WARM = "warm"          # dense weights resident; experts come and go with the plan
    FAILED = "failed"      # could not be opened or loaded; `error` says why

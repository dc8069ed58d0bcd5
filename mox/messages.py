"""The messages that cross layers: a request going in, the outputs coming back, why a request
finished, a model's serving state, and the operator's settings for a model. The server, the
router, the engine and the registry all speak these; nothing here depends on any of them.
"""

from __future__ import annotations

import enum
import math

import msgspec

from mox.errors import InvalidRequestError
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


# Priorities weigh slot values (seconds saved per second); past this they only risk overflow.
MAX_PRIORITY = 1e6
# The longest model name: the registry's limit, and the API's (a longer one is refused before
# it is looked up or echoed in an error).
MAX_MODEL_NAME = 128


class ModelSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The operator's controls for one model, kept in the registry (`mox models set`)."""

    pin: bool = False                   # every expert resident while registered; never parked
    priority: float = 1.0               # weight on the model's value in the memory plan
    keep_alive_s: float | None = None   # idle seconds before its weights leave (None: the
                                        # server's --idle-timeout)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.priority) and 0 < self.priority <= MAX_PRIORITY):
            raise InvalidRequestError(f"priority must be a number in (0, {MAX_PRIORITY:g}], "
                                      f"not {self.priority!r}", param="priority")
        if self.keep_alive_s is not None and not self.keep_alive_s >= 0:
            raise InvalidRequestError(f"keep-alive must be >= 0 seconds, not "
                                      f"{self.keep_alive_s!r}", param="keep_alive")

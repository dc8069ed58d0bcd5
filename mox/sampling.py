"""Sampling parameters and the sampler: temperature, top-k, top-p, per-request seed.

Legend: V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from numbers import Integral, Real

import numpy as np
import torch

from mox.errors import InvalidRequestError, MoxError

# Below this, sampling is greedy: logits / 1e-39 overflow float32 to inf and the softmax to
# NaN, and no temperature this small differs from argmax anyway (vLLM's floor too).
MIN_SAMPLING_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)      # what torch.Generator.manual_seed accepts
# transformers' generate() defaults for the fields mox samples with: a checkpoint's
# generation_config.json value that differs from them sets a request's default, as vLLM's
# `--generation-config auto` applies the differences from GenerationConfig() (these values on
# transformers 4; on 5 an explicit "top_k": 50 would count there, and does not here)
GENERATION_CONFIG_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
# ... and the fields mox has no sampler for, with the values that leave them off
UNAPPLIED_GENERATION_FIELDS = {"repetition_penalty": (1, 1.0), "min_p": (0, 0.0),
                               "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0)}


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_types(params: SamplingParams) -> None:
    """Types first (the offline API passes whatever it is given; the server's msgspec schema
    already did): a clear 400-style error, not a TypeError deep in the sampler."""
    for name in ("max_tokens", "top_k"):
        if not _is_int(getattr(params, name)):
            raise InvalidRequestError(f"{name} must be an integer, got "
                                      f"{getattr(params, name)!r}", param=name)
    for name in ("temperature", "top_p"):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
            raise InvalidRequestError(f"{name} must be a finite number, got {value!r}",
                                      param=name)
    if params.seed is not None and not (_is_int(params.seed)
                                        and SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]):
        raise InvalidRequestError(f"seed must be an integer in [-2^63, 2^64), got "
                                  f"{params.seed!r}", param="seed")
    if not isinstance(params.stop, tuple) or not all(isinstance(s, str) for s in params.stop):
        raise InvalidRequestError(f"stop must be strings, got {params.stop!r}", param="stop")
    if not isinstance(params.stop_token_ids, tuple) or not all(
            _is_int(i) for i in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be token ids, got "
                                  f"{params.stop_token_ids!r}", param="stop_token_ids")


def generation_defaults(config: dict) -> dict[str, float | int]:
    """The sampling defaults a generation_config.json sets: its temperature, top_p and top_k
    where they differ from transformers' own (top_k 0 is off, mox's -1). A value no request
    could give (a string, top_p 0) is left out: the server's default stands."""
    defaults: dict[str, float | int] = {}
    for name, hf_default in GENERATION_CONFIG_DEFAULTS.items():
        value = config.get(name)
        if value is None or value == hf_default or isinstance(value, bool):
            continue
        if name == "top_k" and _is_int(value) and value >= 0:
            defaults[name] = -1 if value == 0 else int(value)
        elif name == "temperature" and isinstance(value, Real) and 0 <= value < math.inf:
            defaults[name] = float(value)
        elif name == "top_p" and isinstance(value, Real) and 0 < value <= 1:
            defaults[name] = float(value)
    return defaults


def unapplied_generation_fields(config: dict) -> dict[str, object]:
    """What a generation_config.json sets that mox cannot sample with (the server logs it)."""
    return {name: config[name] for name, off in UNAPPLIED_GENERATION_FIELDS.items()
            if config.get(name) not in (None, *off)}


def with_model_defaults(defaults: Mapping[str, float | int],
                        **given: float | int | None) -> dict[str, float | int]:
    """The sampling fields `given` (None: the caller left it out) over the model's
    `defaults` (`generation_defaults`) over SamplingParams' own: one rule for the server's
    requests and the offline API's."""
    own = {f.name: f.default for f in fields(SamplingParams)}
    return {name: defaults.get(name, own[name]) if value is None else value
            for name, value in given.items()}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                       # -1: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False                # report the log-probability of each chosen token
    extra_eos: tuple[int, ...] = field(default=(), repr=False)   # the model's eos ids
    # The request parameter `max_tokens` came from, or None where it is a default: a prompt
    # plus an asked-for `max_tokens` past the model's context is refused naming it (as
    # vLLM's OpenAI server does); a default ends at the context instead ("length").
    max_tokens_param: str | None = None

    def __post_init__(self) -> None:
        # one stop string or a list of them, as OpenAI's `stop` takes; lists of token ids
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _check_types(self)
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}",
                                      param="max_tokens")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}",
                                      param="temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k}",
                                      param="top_k")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", param="stop")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def is_stop_token(self, token_id: int) -> bool:
        return token_id in self.stop_token_ids or (
            not self.ignore_eos and token_id in self.extra_eos)

    def new_generator(self, device: torch.device) -> torch.Generator:
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of `logits [S, V]` as host ints (the first of equal maxima, or
    of NaNs, as torch's): numpy's on a CPU, where torch's took 85 us for one row of 32k values
    and 1.3 ms for 32 rows, numpy's 7 and 117 (2-core AMD EPYC VM)."""
    if logits.device.type == "cpu":
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


class NaNLogitsError(MoxError):
    def __init__(self) -> None:
        super().__init__("the model's next-token logits are NaN: its weights or activations "
                         "are not finite (a damaged or badly converted checkpoint?)")


def nan_rows(logits: torch.Tensor, tokens: list[int]) -> list[bool]:
    """Which rows of `logits [S, V]` hold a NaN, given their argmax `tokens` (greedy_tokens
    lands on a row's first NaN, if any): S values read, where scanning the rows for NaNs took
    0.67 ms at 32 rows of 32k (1% of a decode step). numpy's on a CPU, as greedy_tokens: 3.5
    us at one row, where torch's indexing took 11."""
    if logits.device.type == "cpu":
        return np.isnan(logits.numpy()[np.arange(len(tokens)), tokens]).tolist()
    rows = torch.arange(len(tokens), device=logits.device)
    return torch.isnan(logits[rows, torch.tensor(tokens, device=logits.device)]).tolist()


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs [V]` with all but the smallest set of most likely tokens whose mass reaches
    `top_p` zeroed (the top token always survives). The running mass is summed in float64
    and taken as a share of the total: float32's sum drifts over a large vocabulary (at 152k
    tokens it reached 1.000005 and cut ~600 tail tokens that p = 0.9999 keeps)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    wide = sorted_probs.double()
    outside = wide.cumsum(0) - wide >= top_p * wide.sum()
    outside[0] = False
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from next-token logits `[V]` (float32)."""
    if params.is_greedy:
        return greedy_tokens(logits[None])[0]
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = nucleus(probs, params.top_p)
    if torch.isnan(probs[0]):         # a NaN logit makes every probability NaN
        raise NaNLogitsError()
    return int(torch.multinomial(probs, 1, generator=generator))

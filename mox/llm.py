"""The offline API, as vLLM's `LLM`:

    llm = LLM("path/to/checkpoint", device="cpu", dtype="bfloat16")
    outs = llm.generate(["Hello"], max_tokens=16, temperature=0.0)
    outs[0].token_ids, outs[0].text, outs[0].finish_reason
"""

from __future__ import annotations

import enum
import json
import os

import msgspec
import torch

from mox.errors import CheckpointError, InvalidRequestError
from mox.eviction import POLICIES
from mox.loaders import Checkpoint
from mox.models import MoEDecoder, open_model
from mox.pager import make_pager
from mox.sampling import SamplingParams, sample
from mox.tokenizer import Tokenizer
from mox.units import parse_size

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class FinishReason(str, enum.Enum):
    STOP = "stop"        # an eos / stop token or a stop string
    LENGTH = "length"    # max_tokens or the model's context
    ABORT = "abort"


class RequestOutput(msgspec.Struct, omit_defaults=True):
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise InvalidRequestError(f"unsupported dtype {dtype!r}; choose from {sorted(DTYPES)}")
    if resolved == torch.float16 and device.type == "cpu":
        # measured: fp16 matmul on this class of CPU is ~1000x slower than bf16
        raise InvalidRequestError("float16 on CPU is unusably slow; use bfloat16 or float32")
    return resolved


class LLM:
    """`expert_memory`: device bytes for this model's expert slots (None: all resident);
    `host_memory`: a RAM cache of expert bytes between disk and device (None: on a GPU, the
    model's expert bytes up to half the machine's RAM; on a CPU off, the page cache serves);
    `policy`: eviction policy (lru, lfu, rate); `prefetch`: predict and preload the next
    layer's experts (None: on for CUDA, off on CPU; see `prefetch_by_default`)."""

    def __init__(self, model: str, device: str = "cpu", dtype: str | torch.dtype = "bfloat16",
                 expert_memory: int | str | None = None, host_memory: int | str | None = None,
                 policy: str = "rate", prefetch: bool | None = None, direct_io: bool = False):
        if policy not in POLICIES:
            raise InvalidRequestError(f"unknown policy {policy!r}; choose from {POLICIES}")
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.checkpoint = Checkpoint(model)
        host_bytes = parse_size(host_memory)
        if host_bytes is None and self.device.type == "cuda":
            host_bytes = default_host_cache_bytes(self.checkpoint)
        self.pager = make_pager(self.device, host_bytes, direct_io)
        self.model: MoEDecoder = open_model(self.checkpoint, self.dtype, self.device,
                                            self.pager, parse_size(expert_memory), policy,
                                            prefetch)
        self.tokenizer = Tokenizer.from_checkpoint(self.checkpoint.path)
        self.eos_token_ids = _eos_token_ids(self.checkpoint, self.tokenizer)

    def pager_stats(self) -> dict:
        """hits, misses, prefetch_hits, bytes_read (disk + host), read_seconds,
        peak_resident_bytes, budget_bytes, evictions, waves, ..."""
        return self.pager.stats(self.checkpoint.path)

    def generate(self, prompts: str | list[str] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, max_tokens: int = 16,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 seed: int | None = None, stop: str | list[str] | None = None,
                 stop_token_ids: list[int] | None = None,
                 ignore_eos: bool = False) -> list[RequestOutput]:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos,
            extra_eos=self.eos_token_ids)
        return [self._generate_one(ids, params) for ids in self._prompt_ids(prompts,
                                                                            prompt_token_ids)]

    def _prompt_ids(self, prompts: str | list[str] | None,
                    prompt_token_ids: list[list[int]] | None) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is None:
            if self.tokenizer is None:
                raise InvalidRequestError(f"{self.checkpoint.path} has no tokenizer.json; "
                                          "pass prompt_token_ids")
            prompts = [prompts] if isinstance(prompts, str) else prompts
            prompt_token_ids = [self.tokenizer.encode(p) for p in prompts]
        vocab = self.model.spec.vocab_size
        for ids in prompt_token_ids:
            if not ids:
                raise InvalidRequestError("empty prompt")
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return prompt_token_ids

    def _generate_one(self, prompt: list[int], params: SamplingParams) -> RequestOutput:
        max_positions = self.model.spec.max_position_embeddings
        if len(prompt) >= max_positions:
            raise InvalidRequestError(f"prompt has {len(prompt)} tokens; the model's context "
                                      f"is {max_positions}")
        generator = params.new_generator(self.device)
        cache = self.model.new_cache()
        logits = self.model.forward(torch.tensor(prompt), cache)[-1]
        tokens: list[int] = []
        text = None
        while True:
            token = sample(logits, params, generator)
            tokens.append(token)
            if params.is_stop_token(token):
                return self._output(prompt, tokens, FinishReason.STOP)
            if params.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(tokens)
                cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
                if cut >= 0:
                    return RequestOutput(prompt, tokens, FinishReason.STOP, text[:cut])
            if len(tokens) >= params.max_tokens or cache.num_tokens + 1 >= max_positions:
                return self._output(prompt, tokens, FinishReason.LENGTH)
            logits = self.model.forward(torch.tensor([token]), cache)[-1]

    def _output(self, prompt: list[int], tokens: list[int],
                reason: FinishReason) -> RequestOutput:
        text = None if self.tokenizer is None else self.tokenizer.decode(tokens)
        return RequestOutput(prompt, tokens, reason, text)


def default_host_cache_bytes(ckpt: Checkpoint) -> int:
    """With a GPU, keep what was read from disk in RAM: every expert of the model, capped at
    half the machine's memory."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(len(ckpt.experts) * ckpt.expert_nbytes, ram // 2)


def _eos_token_ids(ckpt: Checkpoint, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """eos ids from config.json, generation_config.json and the tokenizer, as HF merges them."""
    ids = set(ckpt.spec.eos_token_ids)
    path = os.path.join(ckpt.path, "generation_config.json")
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError) as e:
            raise CheckpointError(path, f"unreadable JSON: {e}") from e
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))

"""The offline API, as vLLM's `LLM`:

    llm = LLM("path/to/checkpoint", device="cpu", dtype="bfloat16")
    outs = llm.generate(["Hello"], max_tokens=16, temperature=0.0)
    outs[0].token_ids, outs[0].text, outs[0].finish_reason
"""

from __future__ import annotations

import itertools
import json
import os

import msgspec
import torch

from mox.engine.engine import Engine
from mox.engine.scheduler import SchedulerConfig
from mox.engine.sequence import FinishReason, Request
from mox.errors import CheckpointError, InvalidRequestError, MoxError
from mox.eviction import POLICIES
from mox.loaders import Checkpoint
from mox.models import MoEDecoder, open_model
from mox.pager import make_pager
from mox.sampling import SamplingParams
from mox.tokenizer import Tokenizer
from mox.units import parse_size

DEFAULT_KV_MEMORY = "1GiB"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class CompletionOutput(msgspec.Struct, omit_defaults=True):
    """One prompt's whole result."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None
    logprobs: list[float] | None = None


RequestOutput = CompletionOutput   # the name DESIGN.md's offline API uses


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
                 policy: str = "rate", prefetch: bool | None = None, direct_io: bool = False,
                 kv_memory: int | str = DEFAULT_KV_MEMORY, max_batched_tokens: int = 256):
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
        self.name = self.checkpoint.path
        self.engine = Engine(parse_size(kv_memory),
                             config=SchedulerConfig(max_batched_tokens=max_batched_tokens))
        self.engine.add_model(self.name, self.model, self.tokenizer, self.eos_token_ids)
        self._request_counter = itertools.count()

    def pager_stats(self) -> dict:
        """hits, misses, prefetch_hits, bytes_read (disk + host), read_seconds,
        peak_resident_bytes, budget_bytes, evictions, waves, ..."""
        return self.pager.stats(self.checkpoint.path)

    def generate(self, prompts: str | list[str] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, max_tokens: int = 16,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 seed: int | None = None, stop: str | list[str] | None = None,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                 logprobs: bool = False) -> list[CompletionOutput]:
        """All prompts go to the engine at once and are batched together."""
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos,
            logprobs=logprobs)
        prompts_ids = self._prompt_ids(prompts, prompt_token_ids)
        ids = [f"offline-{next(self._request_counter)}" for _ in prompts_ids]
        results = {rid: CompletionOutput(p, [], FinishReason.LENGTH,
                                         None if self.tokenizer is None else "",
                                         [] if logprobs else None)
                   for rid, p in zip(ids, prompts_ids)}
        try:
            for rid, prompt in zip(ids, prompts_ids):
                self.engine.add_request(Request(rid, self.name, prompt, params))
            pending = set(ids)
            while pending:
                for out in self.engine.step():
                    result = results[out.request_id]
                    result.token_ids += out.new_token_ids
                    if result.text is not None:
                        result.text += out.text_delta
                    if out.logprobs is not None:
                        result.logprobs += out.logprobs
                    if out.finish_reason is not None:
                        result.finish_reason = out.finish_reason
                        pending.discard(out.request_id)
                        if out.error is not None:
                            raise self.engine.errors.pop(out.request_id, MoxError(out.error))
        finally:
            for rid in ids:
                self.engine.abort(rid)          # no-op for finished ones
                self.engine.errors.pop(rid, None)
        return [results[rid] for rid in ids]

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
        return [list(p) for p in prompt_token_ids]


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

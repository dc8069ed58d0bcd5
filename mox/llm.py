"""The offline API, as vLLM's `LLM`:

    llm = LLM("path/to/checkpoint", device="cpu", dtype="bfloat16")
    outs = llm.generate(["Hello"], max_tokens=16, temperature=0.0)
    outs[0].token_ids, outs[0].text, outs[0].finish_reason
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading

import msgspec
import torch

from mox.engine.engine import Engine
from mox.errors import InvalidRequestError, ModelUnavailableError, MoxError
from mox.loaders import Checkpoint
from mox.messages import FinishReason, ModelState, Request
from mox.models import MoEDecoder
from mox.pager import ModelPool
from mox.router import ROUTER_POLICIES, Router, RouterConfig
from mox.router.config import DEFAULT_DECODE_STEPS
from mox.router.served_model import dense_nbytes, resolve_device, resolve_dtype
from mox.sampling import SamplingParams, with_model_defaults
from mox.tokenizer import Tokenizer
from mox.units import parse_size

DEFAULT_KV_MEMORY = "1GiB"


class CompletionOutput(msgspec.Struct, omit_defaults=True):
    """One prompt's whole result."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None
    logprobs: list[float] | None = None


RequestOutput = CompletionOutput   # the name DESIGN.md's offline API uses


# The server's queue limits and timeout protect it from clients; one `generate` call queues
# every prompt it is given and waits for them all (vLLM's LLM takes any number), so none apply.
OFFLINE_QUEUE = dict(max_waiting_per_model=sys.maxsize, max_waiting=sys.maxsize,
                     queue_timeout_s=math.inf)


class LLM:
    """One model behind a router of its own. `model`: a checkpoint folder, or a name
    registered in `home` (None: MOX_HOME). `expert_memory`: device bytes for its expert
    slots (None: every expert resident, loaded now); `host_memory`: a RAM cache of expert bytes
    between disk and device (None: on a GPU, the model's expert bytes up to half the
    machine's RAM; on a CPU off: the slots are RAM already); `policy`: any router policy (rate,
    lru, lfu, model-swap, all-resident); `prefetch`: predict and preload the next layer's
    experts (None: on for CUDA, off on CPU; see `prefetch_by_default`); `direct_io`: read
    experts with O_DIRECT where the filesystem allows (no page-cache copy of the weights);
    `decode_steps`: most decode steps a batch runs back to back when nothing else waits
    (fewer where the run would pass `DEFAULT_DECODE_RUN_S`: mox.engine.scheduler)."""

    def __init__(self, model: str, device: str = "cpu", dtype: str | torch.dtype = "bfloat16",
                 expert_memory: int | str | None = None, host_memory: int | str | None = None,
                 policy: str = "rate", prefetch: bool | None = None, direct_io: bool = True,
                 kv_memory: int | str = DEFAULT_KV_MEMORY, max_batched_tokens: int = 256,
                 decode_steps: int = DEFAULT_DECODE_STEPS, home: str | None = None):
        if policy not in ROUTER_POLICIES:
            raise InvalidRequestError(f"unknown policy {policy!r}; choose from "
                                      f"{ROUTER_POLICIES}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.checkpoint = Checkpoint(_checkpoint_path(model, home))
        self.name = self.checkpoint.path
        host_bytes = parse_size(host_memory)
        if host_bytes is None and self.device.type == "cuda":
            host_bytes = default_host_cache_bytes(self.checkpoint)
        expert_bytes = parse_size(expert_memory)
        device_memory = (None if expert_bytes is None
                         else dense_nbytes(self.checkpoint, self.dtype) + expert_bytes)
        self.router = Router({self.name: self.name}, RouterConfig(
            policy=policy, device=device, dtype=self.dtype, device_memory=device_memory,
            host_memory=host_bytes, kv_memory=parse_size(kv_memory),
            max_batched_tokens=max_batched_tokens, prefetch=prefetch, direct_io=direct_io,
            decode_steps=decode_steps, **OFFLINE_QUEUE))
        served = self.router.models[self.name]
        if served.state == ModelState.FAILED:
            raise ModelUnavailableError(served.error)
        self._whole = expert_bytes is None
        self.router.warm_up(self.name, whole=self._whole)
        self.tokenizer: Tokenizer | None = served.tokenizer
        self.sampling_defaults = served.sampling_defaults
        self.eos_token_ids = served.eos_token_ids
        self._request_counter = itertools.count()
        # one generate at a time steps the router (each call collects the outputs of the steps
        # it runs); callers on other threads wait their turn. AsyncEngine serves concurrently.
        self._generating = threading.Lock()

    @property
    def engine(self) -> Engine:
        return self.router.engine

    @property
    def pool(self) -> ModelPool:
        """The model's experts in the pager: its slots, leases, statistics."""
        return self.router.models[self.name].pool

    @property
    def model(self) -> MoEDecoder:
        """The loaded decoder (warm: the router never parks the offline model mid-call)."""
        return self.router.models[self.name].decoder

    def plan(self) -> dict:
        """The router's view: state, traffic, planned slots and pager figures."""
        return self.router.snapshot()

    def pager_stats(self) -> dict:
        """hits, misses, prefetch_hits, bytes_read (disk + host), read_seconds,
        peak_resident_bytes, budget_bytes, evictions, waves, ..."""
        return self.pool.stats()

    def generate(self, prompts: str | list[str] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, max_tokens: int = 16,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None,
                 seed: int | None = None, stop: str | list[str] | None = None,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                 logprobs: bool = False) -> list[CompletionOutput]:
        """All prompts go to the engine at once and are batched together. Calls from several
        threads run one after another. `temperature`, `top_p`, `top_k` left None: the
        checkpoint's generation_config.json values, else SamplingParams' own (as the server's)."""
        params = SamplingParams(
            max_tokens=max_tokens, seed=seed,
            **with_model_defaults(self.sampling_defaults, temperature=temperature, top_p=top_p,
                                  top_k=top_k),
            stop=() if stop is None else stop,
            stop_token_ids=() if stop_token_ids is None else stop_token_ids, ignore_eos=ignore_eos,
            logprobs=logprobs)
        prompts_ids = self._prompt_ids(prompts, prompt_token_ids)
        with self._generating:
            return self._generate(prompts_ids, params)

    def _generate(self, prompts_ids: list[list[int]],
                  params: SamplingParams) -> list[CompletionOutput]:
        logprobs = params.logprobs
        self._reopen_if_failed()
        ids = [f"offline-{next(self._request_counter)}" for _ in prompts_ids]
        results = {rid: CompletionOutput(p, [], FinishReason.LENGTH,
                                         None if self.tokenizer is None else "",
                                         [] if logprobs else None)
                   for rid, p in zip(ids, prompts_ids)}
        try:
            for rid, prompt in zip(ids, prompts_ids):
                self.router.add_request(Request(rid, self.name, prompt, params))
            pending = set(ids)
            while pending:
                if not self.router.has_work:        # its weights are loading (parked model)
                    self.router.wake.wait(self.router.seconds_until_due())
                    self.router.wake.clear()
                for out in self.router.step():
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
                            raise (self.router.take_error(out.request_id)
                                   or MoxError(out.error))
        finally:
            for rid in ids:
                self.router.abort(rid)          # no-op for finished ones
                self.router.take_error(rid)
        return [results[rid] for rid in ids]

    def _reopen_if_failed(self) -> None:
        """A file damaged while serving failed the model; opening it again serves it again
        once the file is repaired (or fails again, naming the file)."""
        if self.router.models[self.name].state != ModelState.FAILED:
            return
        served = self.router.reopen(self.name)
        if served.state == ModelState.FAILED:
            raise ModelUnavailableError(served.error)
        self.router.warm_up(self.name, whole=self._whole)

    def _prompt_ids(self, prompts: str | list[str] | None,
                    prompt_token_ids: list[list[int]] | None) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is None:
            if self.tokenizer is None:
                raise InvalidRequestError(f"{self.checkpoint.path} has no tokenizer.json; "
                                          "pass prompt_token_ids")
            prompts = [prompts] if isinstance(prompts, str) else prompts
            if not isinstance(prompts, list | tuple) or not all(isinstance(p, str)
                                                                for p in prompts):
                raise InvalidRequestError("prompts must be a string or a list of strings",
                                          param="prompt")
            prompt_token_ids = [self.tokenizer.encode(p) for p in prompts]
        if not isinstance(prompt_token_ids, list | tuple) or not all(
                isinstance(p, list | tuple) for p in prompt_token_ids):
            raise InvalidRequestError("prompt_token_ids must be a list of lists of token ids",
                                      param="prompt")
        return [list(p) for p in prompt_token_ids]


def _checkpoint_path(model: str, home: str | None) -> str:
    """A folder as given; otherwise a name registered in `home`'s registry (None: MOX_HOME's)."""
    if os.path.isdir(model) or os.sep in model:
        return model
    from mox.registry import Registry

    return Registry(home).get(model).path


def default_host_cache_bytes(ckpt: Checkpoint) -> int:
    """With a GPU, keep what was read from disk in RAM: every expert of the model, capped at
    half the machine's memory."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(len(ckpt.experts) * ckpt.expert_nbytes, ram // 2)

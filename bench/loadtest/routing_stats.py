"""Routing realism: how skewed and how repetitive a model's expert choices are on the
workload's own prompts, measured offline beside every load-test result.

Random-weight routers route almost uniformly and with no memory from token to token; trained
ones are skewed and temporally local (a per-layer LRU holding a quarter of the experts hits
about 60-70% in published measurements). Per MoE layer:

- `entropy`: of the expert popularity, divided by log(E) (1.0 = uniform);
- `previous_token_overlap`: the mean share of a token's k experts that the previous token of
  the same sequence also used (k/E when choices are independent and uniform);
- `lru_quarter_hit_rate`: hits of an LRU cache of E/4 experts of the layer, fed every
  token's experts in order (sequence after sequence, as a server would see them alone).

The top-k ids are recorded by wrapping `mox.models.moe.route` (the MoE block looks it up at
each call) while `mox.LLM` generates each prompt alone, so token order is sequence order.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import numpy as np
import torch

from mox.bench.loadtest.workload import RequestSpec

ROUTING_MAX_TOKENS = 32          # generated tokens per measured sequence (decode locality)
LRU_SHARE = 0.25                 # the published per-layer LRU size: a quarter of the experts


class RoutingLayer(msgspec.Struct):
    moe_layer: int
    entropy: float
    previous_token_overlap: float
    lru_quarter_hit_rate: float


class RoutingStats(msgspec.Struct):
    model: str
    num_sequences: int
    num_tokens: int                  # routed tokens per layer
    num_experts: int
    top_k: int
    uniform_overlap: float           # k/E: the overlap of independent uniform choices
    mean_entropy: float
    mean_previous_token_overlap: float
    mean_lru_quarter_hit_rate: float
    layers: list[RoutingLayer]


@contextmanager
def recording_routes() -> Iterator[dict[int, list[torch.Tensor]]]:
    """While open, every MoE block's top-k ids `[T, k]` are appended to its layer's list
    (`route(spec, w: MoEWeights, x)`; the decoder's next-layer prefetch prediction holds its
    own reference to `route`, so predictions are not recorded as choices)."""
    from mox.models import moe

    calls: dict[int, list[torch.Tensor]] = defaultdict(list)
    original = moe.route

    def recorded(spec, w, x):
        weights, ids = original(spec, w, x)
        calls[w.moe_layer].append(ids.to("cpu", torch.int64))
        return weights, ids

    moe.route = recorded
    try:
        yield calls
    finally:
        moe.route = original


def record_sequences(path: str, prompts: list[list[int]],
                     max_tokens: int) -> tuple[dict[int, list[np.ndarray]], int, int]:
    """Per MoE layer, each sequence's top-k ids `[T, k]` in token order; also E and k."""
    from mox import LLM

    llm = LLM(path, dtype="bfloat16")
    spec = llm.checkpoint.spec
    per_layer: dict[int, list[np.ndarray]] = defaultdict(list)
    for prompt in prompts:
        with recording_routes() as calls:
            llm.generate(prompt_token_ids=[prompt], max_tokens=max_tokens, temperature=0.0,
                         ignore_eos=True)
        for layer, chunks in calls.items():
            per_layer[layer].append(torch.cat(chunks).numpy())               # [T, k]
    return per_layer, spec.num_experts, spec.top_k


def layer_statistics(moe_layer: int, sequences: list[np.ndarray],
                     num_experts: int) -> RoutingLayer:
    top_k = sequences[0].shape[1]
    counts = np.bincount(np.concatenate([s.ravel() for s in sequences]), minlength=num_experts)
    p = counts[counts > 0] / counts.sum()
    entropy = float(-(p * np.log(p)).sum() / math.log(num_experts))
    overlaps = []
    for ids in sequences:
        chosen = np.zeros((len(ids), num_experts), dtype=bool)                # [T, E]
        np.put_along_axis(chosen, ids, True, axis=1)
        overlaps.append((chosen[1:] & chosen[:-1]).sum(axis=1) / top_k)       # [T-1]
    overlap = np.concatenate(overlaps)
    return RoutingLayer(moe_layer, entropy, float(overlap.mean()) if overlap.size else 0.0,
                        lru_hit_rate(sequences, max(1, int(LRU_SHARE * num_experts))))


def lru_hit_rate(sequences: list[np.ndarray], capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for ids in sequences:
        for token in ids:
            for expert in token.tolist():
                total += 1
                if expert in cache:
                    hits += 1
                    cache.move_to_end(expert)
                else:
                    cache[expert] = None
                    if len(cache) > capacity:
                        cache.popitem(last=False)
    return hits / total if total else 0.0


def routing_statistics(model: str, per_layer: dict[int, list[np.ndarray]], num_experts: int,
                       top_k: int) -> RoutingStats:
    layers = [layer_statistics(i, per_layer[i], num_experts) for i in sorted(per_layer)]
    mean = lambda field: float(np.mean([getattr(layer, field) for layer in layers]))
    first = per_layer[min(per_layer)]
    return RoutingStats(model, len(first), sum(len(s) for s in first), num_experts, top_k,
                        top_k / num_experts, mean("entropy"), mean("previous_token_overlap"),
                        mean("lru_quarter_hit_rate"), layers)


def measure_routing(path: str, requests: list[RequestSpec], num_sequences: int,
                    model: str | None = None) -> RoutingStats | None:
    """Routing statistics of the checkpoint at `path` on the first `num_sequences` prompts of
    the workload (None when there are none)."""
    chosen = requests[:num_sequences]
    if not chosen:
        return None
    prompts = [spec.prompt_token_ids() for spec in chosen]
    max_tokens = min(ROUTING_MAX_TOKENS, max(spec.max_tokens for spec in chosen))
    per_layer, num_experts, top_k = record_sequences(path, prompts, max_tokens)
    if not per_layer:
        return None                  # nothing routed through the wrapper: not measurable
    return routing_statistics(model or path, per_layer, num_experts, top_k)

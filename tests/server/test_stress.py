"""Liveness under a tight budget: rounds of concurrent streams over four demo models, half of
the clients leaving after their first tokens. Every round must complete within a generous
bound (10x a healthy round), every stream that stays must get all its tokens, and the KV pool
and the pools' tables must be whole afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import aiohttp

from mox.router import Router, RouterConfig
from mox.serve import RouterBackend
from mox.server.app import create_app
from tests.server.conftest import LiveServer, wait_until

MODELS = ("olmoe-demo", "qwen2-moe-demo", "qwen3-moe-demo", "mixtral-demo")
BUDGET = 64 << 20                # every model's dense weights, and a fraction of the experts
ROUNDS, STREAMS, MAX_TOKENS = 10, 100, 16
FIRST_ROUND_S = 120.0            # includes four cold starts
HEALTHY_FACTOR, MIN_BOUND_S = 10.0, 20.0


async def _stream(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                  leave: bool) -> int:
    """Completion tokens the usage chunk reports (-1: the client left after two chunks)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    chunks, tokens = 0, None
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                return tokens
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            chunks += 1
            if leave and chunks >= 2:
                return -1
    raise AssertionError("stream ended without [DONE]")


async def _round(url: str, rng: random.Random, bound_s: float) -> float:
    start = time.monotonic()
    async with aiohttp.ClientSession() as session:
        streams = [_stream(session, url, rng.choice(MODELS),
                           [rng.randrange(3, 90) for _ in range(rng.randrange(4, 40))],
                           leave=i % 2 == 1)
                   for i in range(STREAMS)]
        received = await asyncio.wait_for(asyncio.gather(*streams), bound_s)
    assert all(n == MAX_TOKENS for n in received[0::2]), received[0::2]    # those that stayed
    return time.monotonic() - start


def test_rounds_of_streams_under_a_tight_budget_all_complete(demo_home):
    paths = {name: os.path.join(demo_home, "models", name) for name in MODELS}
    backend = RouterBackend(Router(paths, RouterConfig(device_memory=BUDGET,
                                                       kv_memory=256 << 20)))
    server = LiveServer(create_app(backend))
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    rng = random.Random(0)
    try:
        times = [asyncio.run(_round(url, rng, FIRST_ROUND_S))]
        healthy = asyncio.run(_round(url, rng, FIRST_ROUND_S))
        times.append(healthy)
        bound = max(MIN_BOUND_S, HEALTHY_FACTOR * healthy)
        for _ in range(ROUNDS - 2):
            times.append(asyncio.run(_round(url, rng, bound)))   # TimeoutError: a stall
        router = backend.router
        assert wait_until(lambda: router.engine.num_live == 0)
        assert router.engine.kv_pool.used_bytes == 0
        for model in router.models.values():
            model.pool.check_integrity()
        assert router.residency.used_bytes() <= BUDGET
    finally:
        server.close()
        backend.shutdown()

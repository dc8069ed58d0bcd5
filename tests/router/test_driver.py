"""The async driver (mox.router.driver): streaming, concurrency, cancellation, errors."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from mox.engine import Engine
from mox.errors import InvalidRequestError, ModelNotFoundError
from mox.messages import FinishReason, Request
from mox.router.driver import AsyncEngine
from mox.sampling import SamplingParams
from tests.conftest import open_tiny, serve_loaded, tiny_router

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _async_engine(hf_checkpoints) -> tuple[AsyncEngine, Engine]:
    router = tiny_router(hf_checkpoints["olmoe"][0])
    return AsyncEngine(router), router.engine


def test_concurrent_streams_match_the_sync_engine(hf_checkpoints):
    async_engine, engine = _async_engine(hf_checkpoints)

    async def collect(request: Request) -> list[int]:
        tokens, reasons = [], []
        async for out in async_engine.generate(request):
            tokens += out.new_token_ids
            reasons.append(out.finish_reason)
        assert reasons[-1] == FinishReason.LENGTH and all(r is None for r in reasons[:-1])
        return tokens

    async def main():
        requests = [Request(f"r{i}", "olmoe", [1 + i, 2, 3], GREEDY) for i in range(4)]
        return await asyncio.gather(*(collect(r) for r in requests))

    streamed = asyncio.run(main())
    async_engine.shutdown()
    sync = Engine(64 << 20, block_size=4)
    serve_loaded(sync, "olmoe", open_tiny(hf_checkpoints["olmoe"][0]))
    for i in range(4):
        sync.add_request(Request(f"r{i}", "olmoe", [1 + i, 2, 3], GREEDY))
    expected: dict[str, list[int]] = {}
    while sync.has_work:
        for out in sync.step():
            expected.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert streamed == [expected[f"r{i}"] for i in range(4)]


def test_a_cancelled_stream_frees_its_kv(hf_checkpoints):
    async_engine, engine = _async_engine(hf_checkpoints)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main() -> int:
        stream = async_engine.generate(Request("r", "olmoe", [5, 6, 7], long))
        first = await stream.__anext__()
        assert first.new_token_ids
        await stream.aclose()                       # the client went away
        done: concurrent.futures.Future = concurrent.futures.Future()
        async_engine.call(
            lambda r: done.set_result((r.engine.kv_pool.used_bytes, r.engine.num_live)))
        return await asyncio.wrap_future(done)

    assert asyncio.run(main()) == (0, 0)
    async_engine.shutdown()


def test_bad_requests_reach_the_caller(hf_checkpoints):
    async_engine, _ = _async_engine(hf_checkpoints)

    async def main():
        async for _ in async_engine.generate(Request("x", "nope", [1], GREEDY)):
            pass

    with pytest.raises(ModelNotFoundError, match="nope"):
        asyncio.run(main())
    async_engine.shutdown()


def test_a_duplicate_request_id_is_refused_and_the_first_runs_on(hf_checkpoints):
    async_engine, _ = _async_engine(hf_checkpoints)

    async def collect(request: Request) -> list[int]:
        return [t async for out in async_engine.generate(request) for t in out.new_token_ids]

    async def main():
        first = asyncio.create_task(collect(Request("same", "olmoe", [1, 2, 3], GREEDY)))
        await asyncio.sleep(0)                     # the first stream is registered
        with pytest.raises(InvalidRequestError, match="already running"):
            await collect(Request("same", "olmoe", [4, 5], GREEDY))
        return await asyncio.wait_for(first, timeout=60)

    assert len(asyncio.run(main())) == GREEDY.max_tokens
    async_engine.shutdown()


def test_the_router_sees_work_waiting_in_the_loops_inbox(hf_checkpoints):
    """A run of decode steps ends when a request or an abort waits in the inbox (the
    engine's interrupt): the router's `outside_waiting` reads it."""
    async_engine, engine = _async_engine(hf_checkpoints)
    router = async_engine.driver
    busy, release, done = (concurrent.futures.Future(), concurrent.futures.Future(),
                           concurrent.futures.Future())
    try:
        async_engine.call(lambda _: (busy.set_result(True), release.result(timeout=30)))
        busy.result(timeout=30)             # the loop runs the first command: inbox empty
        assert not router.outside_waiting() and not engine.interrupt()
        async_engine.call(lambda _: done.set_result(True))
        assert router.outside_waiting() and engine.interrupt()
        release.set_result(True)
        done.result(timeout=30)
        assert not router.outside_waiting()
    finally:
        if not release.done():
            release.set_result(True)
        async_engine.shutdown()

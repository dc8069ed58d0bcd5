"""The async interface (streaming, concurrency, cancellation) and incremental text."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

import pytest

from mox.engine import Engine
from mox.engine.detokenizer import INCOMPLETE_CHAR, IncrementalDetokenizer
from mox.errors import ModelNotFoundError
from mox.messages import FinishReason, Request
from mox.router.driver import AsyncEngine
from mox.sampling import SamplingParams
from mox.tokenizer import Tokenizer
from tests.conftest import open_tiny, serve_loaded, tiny_router

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(demo_home):
    return Tokenizer(os.path.join(demo_home, "models", "olmoe-demo", "tokenizer.json"))


def test_multibyte_characters_are_never_split(tokenizer):
    text = "Héllo wörld, 日本語のテキスト, emoji 🙂 and more."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=())
    deltas = [detok.push([t]) for t in ids]
    assert all(INCOMPLETE_CHAR not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert any(d == "" for d in deltas)          # some token ended mid-character and waited


def test_stop_string_spanning_tokens_is_found(tokenizer):
    text = "The weather is sunny with a light breeze"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    # a stop string made of the end of one token and the start of the next
    i = next(i for i in range(len(pieces) - 1) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 1)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    detok = IncrementalDetokenizer(tokenizer, stop=(stop,))
    emitted = ""
    for t in ids:
        emitted += detok.push([t])
        if detok.stopped:
            break
    assert detok.stopped and emitted == text[:text.find(stop)]


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

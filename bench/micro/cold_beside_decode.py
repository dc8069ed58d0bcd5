"""A cold start beside a decoding model: how fast the cold model's experts are read and how much
the warm model's decode slows meanwhile, through `mox serve` (issue 16's timeline showed both
collapsing in the load test: cold reads at ~0.3 GB/s against ~1 GB/s alone, decode steps of
200+ ms against 15).

Per trial: model A (warm) streams `--decode-tokens` tokens; once it has produced 40, a request to
model B (parked, its experts on disk) arrives and asks for one token. Reported: B's TTFT (its
cold read) and A's inter-token gaps before and during B's cold start. The server runs with each
`--variant` (extra `mox serve` arguments; the default pair compares the engine's default
compute threads with a fixed team of every core), trials alternating between variants; the
page cache plays no part (mox reads experts with O_DIRECT).

    .venv/bin/python -m mox.bench.micro.cold_beside_decode --models-dir /tmp/bh-bench/models
        [--trials 3] [--variant ''] [--variant '--compute-threads 2'] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
import time

import aiohttp
import numpy as np

from mox.bench.micro.stream_rounds import start_server
from mox.engine.threads import COMPUTE_THREADS
from mox.registry import Registry

WARM, COLD = "olmoe-bench", "olmoe-bench-1"
COLD_AFTER_TOKENS = 40


async def stream_gaps(session: aiohttp.ClientSession, url: str, body: dict,
                      started: asyncio.Event) -> list[float]:
    """Arrival times of each streamed chunk; sets `started` after COLD_AFTER_TOKENS."""
    times: list[float] = []
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
                if len(times) == COLD_AFTER_TOKENS:
                    started.set()
    return times


async def trial(base: str, decode_tokens: int) -> dict:
    url = base + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        warm = {"model": WARM, "prompt": "warm up", "max_tokens": 1}
        async with session.post(url, json=warm) as response:
            assert response.status == 200, await response.text()
        started = asyncio.Event()
        body = {"model": WARM, "prompt": [5, 6, 7, 8], "max_tokens": decode_tokens,
                "stream": True, "ignore_eos": True}
        stream = asyncio.create_task(stream_gaps(session, url, body, started))
        await started.wait()
        sent = time.perf_counter()
        cold = {"model": COLD, "prompt": [9, 10, 11] * 10, "max_tokens": 1}
        async with session.post(url, json=cold) as response:
            assert response.status == 200, await response.text()
            await response.read()
        ttft = time.perf_counter() - sent
        times = await stream
    gaps = np.diff(times) * 1000
    arrivals = np.array(times[1:])
    during = gaps[(arrivals > sent) & (arrivals <= sent + ttft)]
    before = gaps[:COLD_AFTER_TOKENS - 1]
    return {"cold_ttft_s": ttft, "tpot_before_ms": float(np.median(before)),
            "tpot_during_ms": float(np.median(during)) if len(during) else float("nan"),
            "tokens_during": int(len(during))}


async def fresh_server_trial(home: str, budget: str, extra: list[str],
                             decode_tokens: int) -> dict:
    """One trial on a server of its own, so B is cold (its step log in a temp folder)."""
    with tempfile.TemporaryDirectory(prefix="mox-cold-beside-log-") as logs:
        server, base = start_server(home, budget, "rate", os.path.join(logs, "steps.jsonl"),
                                    extra)
        try:
            return await trial(base, decode_tokens)
        finally:
            server.terminate()
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", required=True,
                        help="folder holding the bench models (mox bench --home H: H/models)")
    parser.add_argument("--budget", default="4GiB", help="room for both models whole")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=600)
    parser.add_argument("--variant", action="append",
                        help="extra mox serve arguments (repeatable; default: '' and "
                             "'--compute-threads N' for every core, the engine's team before "
                             "it left a core to in-flight reads)")
    parser.add_argument("--out")
    args = parser.parse_args()
    argv = [shlex.quote(a) for a in sys.argv[1:]]
    variants = args.variant or ["", f"--compute-threads {COMPUTE_THREADS}"]
    home = tempfile.mkdtemp(prefix="mox-cold-beside-")
    registry = Registry(home)
    for name in (WARM, COLD):
        registry.add(name, os.path.join(args.models_dir, name))
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.trials):
        for variant in variants:                    # alternate: noise hits both alike
            rows[variant].append(asyncio.run(fresh_server_trial(
                home, args.budget, shlex.split(variant), args.decode_tokens)))
            print(variant or "(default)", rows[variant][-1], flush=True)
    lines = ["| variant | cold TTFT s (each trial) | A's TPOT before ms | A's TPOT during "
             "B's cold start ms |", "|---|---|---|---|"]
    for variant, results in rows.items():
        cells = [" / ".join(format(r[key], fmt) for r in results)
                 for key, fmt in [("cold_ttft_s", ".2f"), ("tpot_before_ms", ".0f"),
                                  ("tpot_during_ms", ".0f")]]
        lines.append(f"| {variant or '(default)'} | {' | '.join(cells)} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"`{' '.join(['python -m mox.bench.micro.cold_beside_decode', *argv])}`"
                    f", load {os.getloadavg()[0]:.2f} at the end\n\n{text}\n")


if __name__ == "__main__":
    main()

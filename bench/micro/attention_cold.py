"""Decode attention with its keys cold, as inside a decode step (where the layers' weights
stream through the caches between two attention calls), against a gather of the same slots.

Each pass flushes the caches (a 64 MiB sum), then times one call of the native decode
attention (`mox.kernels.native`) over the engine's blocks of 16 slots scattered over a store
eight times the size in use; the same after a one-token, one-block call gives the fixed cost
(the OpenMP team waking, the call), which is subtracted. GB/s: keys and values read. Beside
it, torch's `index_select` of the same slots (a gather with no arithmetic), timed the same way.

    .venv/bin/python -m mox.bench.micro.attention_cold [--tokens 32] [--keys 144]
        [--kv-heads 4] [--passes 40]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from mox.bench.machine import past_the_cache
from mox.engine.engine import DEFAULT_BLOCK_SIZE as KV_BLOCK
from mox.kernels import native

HEAD_DIM, GROUP = 64, 4           # the bench olmoe's heads: 64 dims, 4 query heads a KV head
SPREAD = 8                        # the store: this many times the slots in use
FLUSH_FLOATS = past_the_cache(64 << 20) // 4   # summed before each call: past the last-level cache


def timed(flush: torch.Tensor, call: Callable[[], object], passes: int) -> float:
    """Median seconds of `call` right after a flush of the caches."""
    times = []
    for _ in range(passes + 2):
        flush.sum()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--keys", type=int, default=144, help="keys per token")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--passes", type=int, default=40)
    args = ap.parse_args()
    kernels = native.kernels()
    if kernels is None:
        raise SystemExit("no native kernels here")
    torch.set_num_threads(2)      # the flush and the gather on both cores, as the kernels
    generator = torch.Generator().manual_seed(1)
    blocks = -(-args.tokens * args.keys // KV_BLOCK)
    keys, values = (torch.randn(SPREAD * blocks * KV_BLOCK, args.kv_heads, HEAD_DIM,
                                generator=generator).bfloat16() for _ in range(2))
    chosen = torch.randperm(SPREAD * blocks, generator=generator)[:blocks]
    slots = (chosen[:, None] * KV_BLOCK + torch.arange(KV_BLOCK)).flatten()
    slots = slots[:args.tokens * args.keys]
    q = torch.randn(args.tokens, GROUP * args.kv_heads, HEAD_DIM, generator=generator).bfloat16()
    starts = torch.arange(args.tokens) * args.keys
    lengths = torch.full((args.tokens,), args.keys)
    flush = torch.ones(FLUSH_FLOATS, dtype=torch.float32)
    scale = HEAD_DIM ** -0.5
    one = (torch.zeros(1, dtype=torch.long), torch.full((1,), KV_BLOCK))
    fixed = timed(flush, lambda: kernels.decode_attention(q[:1], keys, values, slots, *one,
                                                          scale, None), args.passes)
    attend = timed(flush, lambda: kernels.decode_attention(q, keys, values, slots, starts,
                                                           lengths, scale, None), args.passes)
    gather = timed(flush, lambda: (keys.index_select(0, slots), values.index_select(0, slots)),
                   args.passes)
    nbytes = 2 * slots.numel() * args.kv_heads * HEAD_DIM * keys.element_size()
    print(f"{args.tokens} tokens x {args.keys} keys, {args.kv_heads} KV heads of {HEAD_DIM}: "
          f"{nbytes / 2**20:.1f} MiB of keys and values, cold")
    net = (f"{nbytes / (attend - fixed) / 1e9:.1f} GB/s net" if attend > fixed
             else "the fixed cost swamped the call")
    print(f"  attention {attend * 1e3:.3f} ms, fixed {fixed * 1e3:.3f} ms: {net}")
    print(f"  gather    {gather * 1e3:.3f} ms: {nbytes / gather / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()

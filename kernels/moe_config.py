"""Block sizes for the Triton fused-MoE kernels.

Tuned configs live in `configs/` as JSON, one file per (E, N, device, dtype), mapping a token
count M to block sizes (the layout vLLM uses, so its tuning habits carry over);
`bench/micro/tune_moe.py` writes them on a GPU. Without a file, a small-batch default (few rows per
expert: narrow M tiles, deep K) and a large-batch default apply.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass

import torch

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class MoEKernelConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1          # M blocks that share an N column, for L2 reuse of weight tiles
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for size in (self.block_m, self.block_n, self.block_k):
            assert size >= 16 and size & (size - 1) == 0, "block sizes are powers of two >= 16"

    def to_json(self) -> dict:
        return asdict(self)


SMALL_BATCH = MoEKernelConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4,
                              num_stages=4)
LARGE_BATCH = MoEKernelConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8,
                              num_stages=3)


def config_file_name(num_experts: int, inter: int, device_name: str, dtype: torch.dtype) -> str:
    device = device_name.replace(" ", "_")
    return f"E={num_experts},N={inter},device_name={device},dtype={DTYPE_NAMES[dtype]}.json"


@functools.lru_cache(maxsize=64)
def _load(path: str) -> dict[int, MoEKernelConfig] | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        table = json.load(f)   # token count -> config (plus a recorded timing, ignored)
    fields = MoEKernelConfig.__dataclass_fields__
    return {int(m): MoEKernelConfig(**{k: v for k, v in cfg.items() if k in fields})
            for m, cfg in table.items()}


def get_config(num_experts: int, inter: int, device_name: str, dtype: torch.dtype,
               num_tokens: int) -> MoEKernelConfig:
    """The tuned config for the nearest token count, else the default for this batch size."""
    table = _load(os.path.join(CONFIG_DIR, config_file_name(num_experts, inter, device_name,
                                                            dtype)))
    if table:
        return table[min(table, key=lambda m: abs(m - num_tokens))]
    # Below ~E tokens most experts see a row or two: wide M tiles would be mostly padding.
    return SMALL_BATCH if num_tokens <= num_experts else LARGE_BATCH

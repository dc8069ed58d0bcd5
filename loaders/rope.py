"""RoPE as a checkpoint configures it: base, how much of each head rotates, pair layout, and
the context-extension scaling (`rope_parameters` in transformers 5, `rope_scaling` plus
`rope_theta` in published configs). Unsupported scalings are refused here, by name."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError

ROPE_DEFAULT, ROPE_YARN = "default", "yarn"
SUPPORTED_ROPE_TYPES = (ROPE_DEFAULT, ROPE_YARN)
# YaRN's ramp boundaries (in rotations over the original context) when a config omits them.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_dim: int                  # leading dims of each head that rotate (< head_dim: partial)
    interleaved: bool = False        # rotate pairs (x0, x1), (x2, x3) (DeepSeek), not halves
    scaling: str = ROPE_DEFAULT      # ROPE_DEFAULT | ROPE_YARN
    factor: float = 1.0              # yarn: context extension factor
    original_max_position_embeddings: int = 0
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    truncate: bool = True            # yarn: round the correction range outwards
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None   # yarn: cos/sin scale; None = derived (`rope_scale`)


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def parse_rope(config: dict[str, Any], path: str, head_dim: int, interleaved: bool = False,
               default_partial_factor: float = 1.0) -> RopeSpec:
    params = rope_parameters(config)
    kind = params.get("rope_type", params.get("type", ROPE_DEFAULT))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(path, f"unsupported rope_scaling type {kind!r}; supported: "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor",
                         config.get("partial_rotary_factor", default_partial_factor))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise CheckpointError(path, f"partial_rotary_factor {partial} gives {rotary_dim} "
                              f"rotary dims of a {head_dim}-dim head (need an even number)")
    if kind == ROPE_DEFAULT:
        return RopeSpec(theta, rotary_dim, interleaved)
    original = (params.get("original_max_position_embeddings")
                or config.get("original_max_position_embeddings")
                or config.get("max_position_embeddings", 4096))
    factor = params.get("factor") or config.get("max_position_embeddings", original) / original
    return RopeSpec(
        theta, rotary_dim, interleaved, ROPE_YARN, float(factor), int(original),
        float(params.get("beta_fast") or YARN_BETA_FAST),
        float(params.get("beta_slow") or YARN_BETA_SLOW),
        bool(params.get("truncate", True)), params.get("mscale"), params.get("mscale_all_dim"),
        params.get("attention_factor"))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_scale(rope: RopeSpec) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
    if rope.scaling != ROPE_YARN:
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor,
                                                                   rope.mscale_all_dim)
    return yarn_mscale(rope.factor)

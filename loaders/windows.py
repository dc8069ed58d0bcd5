"""Which layers of a model attend through a sliding window, per architecture, as transformers
attends: each function maps (config.json, num_layers) to a window (or None) per layer.

Qwen's own documentation of `max_window_layers` says the layers above it slide; transformers'
Qwen2-MoE slides the even layers below it and Qwen3-MoE every layer. transformers is the oracle
mox is checked against, and every published Qwen MoE config has use_sliding_window false."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _layer_windows(config: dict[str, Any], slides: Callable[[int], bool],
                   num_layers: int) -> tuple[int | None, ...]:
    """`sliding_window` on the layers `config["layer_types"]` names sliding, or else on those
    `slides` picks."""
    window = config.get("sliding_window") or None
    layer_types = config.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return tuple(window if slides(i) else None for i in range(num_layers))


def every_layer_window(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Mixtral: `sliding_window` (if set) on every layer."""
    return (config.get("sliding_window") or None,) * num_layers


def qwen2_moe_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    if not config.get("use_sliding_window"):
        return (None,) * num_layers
    below = config["max_window_layers"]
    return _layer_windows(config, lambda i: i % 2 == 0 and i < below, num_layers)


def qwen3_moe_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    if not config.get("use_sliding_window"):
        return (None,) * num_layers
    return every_layer_window(config, num_layers)


def gpt_oss_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Sliding and full layers alternate, sliding first, unless `layer_types` says."""
    return _layer_windows(config, lambda i: i % 2 == 0, num_layers)

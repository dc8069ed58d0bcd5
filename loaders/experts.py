"""The expert index: (layer, expert) -> the byte ranges of that expert's weights, each tagged
with the role it plays in a slot (`w13 [2I, H]` gate rows then up rows, `w2 [H, I]`, and the
biases `b13 [2I]`, `b2 [H]` where a model has them).

Separately stored experts (Mixtral, Qwen, OLMoE, DeepSeek, GLM) are one tensor per
projection, stored as the slot holds them. Fused checkpoints (GPT-OSS) hold all E experts in
one `[E, ...]` tensor per projection: expert e's bytes are index e of each, one contiguous
range, so the pager pages one expert of a fused tensor exactly as it pages a separate one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mox.kernels.quant import MXFP4_GROUP32

from .errors import CheckpointError
from .layout import expert_tensors, fused_expert_tensors, is_fused
from .quantized import StoredWeight, WeightFormat
from .safetensors_format import TensorInfo
from .spec import EXPERTS_FUSED, ModelSpec

# Roles: which slot tensor a part fills, and how its stored layout maps onto it.
GATE, UP, DOWN = "gate", "up", "down"             # [I, H], [I, H], [H, I]: as the slot holds them
# Quantized experts (loaders.quantized): each weight's scales beside it, stored as the slot
# holds them too
GATE_SCALE, UP_SCALE, DOWN_SCALE = "gate_scale", "up_scale", "down_scale"
GATE_UP_T = "gate_up_t"           # [H, 2I], columns gate_0, up_0, gate_1, ... (GPT-OSS)
DOWN_T = "down_t"                 # [I, H] (GPT-OSS)
GATE_UP_BIAS = "gate_up_bias"     # [2I], gate_0, up_0, gate_1, ... (GPT-OSS)
DOWN_BIAS = "down_bias"           # [H]
# MXFP4 (GPT-OSS as published): rows in output order (gate_up rows interleaved as above),
# held as stored in the slot (mox.kernels.quant), the E8M0 scales decoded to float32 on load
GATE_UP_BLOCKS, GATE_UP_SCALES = "gate_up_blocks", "gate_up_scales"   # [2I, H/32, 16], [2I, H/32]
DOWN_BLOCKS, DOWN_SCALES = "down_blocks", "down_scales"               # [H, I/32, 16], [H, I/32]
MXFP4_ROLES = (GATE_UP_BLOCKS, GATE_UP_SCALES, DOWN_BLOCKS, DOWN_SCALES)

_FUSED_ROLES = {"gate_up_proj": GATE_UP_T, "down_proj": DOWN_T,
                "gate_up_proj_bias": GATE_UP_BIAS, "down_proj_bias": DOWN_BIAS,
                "gate_up_proj_blocks": GATE_UP_BLOCKS, "gate_up_proj_scales": GATE_UP_SCALES,
                "down_proj_blocks": DOWN_BLOCKS, "down_proj_scales": DOWN_SCALES}


@dataclass(frozen=True)
class ExpertPart:
    """One piece of an expert's bytes. `info` names its tensor; for a fused tensor it is
    this expert's slice (offset, size and shape of index e)."""

    info: TensorInfo
    role: str


@dataclass(frozen=True)
class ExpertTensors:
    parts: tuple[ExpertPart, ...]
    fmt: WeightFormat | None = None       # the weights are stored quantized in this format

    @property
    def infos(self) -> tuple[TensorInfo, ...]:
        return tuple(part.info for part in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(part.info.nbytes for part in self.parts)

    def part(self, role: str) -> TensorInfo:
        for part in self.parts:
            if part.role == role:
                return part.info
        raise KeyError(f"expert has no {role!r} part (roles: {[p.role for p in self.parts]})")

    # separately stored experts: their three tensors by name
    @property
    def gate(self) -> TensorInfo:
        return self.part(GATE)

    @property
    def up(self) -> TensorInfo:
        return self.part(UP)

    @property
    def down(self) -> TensorInfo:
        return self.part(DOWN)


def expert_index(spec: ModelSpec, stored: Callable[[str], StoredWeight],
                 info: Callable[[str], TensorInfo]) -> dict[tuple[int, int], ExpertTensors]:
    """Every expert of every MoE layer; `stored` looks a weight up by its logical name,
    `info` a tensor by its name."""
    moe_layers = [layer for layer in range(spec.num_layers) if spec.moe_layers[layer]]
    if not is_fused(spec):
        return {(layer, expert): _separate(spec, stored, layer, expert)
                for layer in moe_layers for expert in range(spec.num_experts)}
    index = {}
    for layer in moe_layers:
        fused = [(info(name), _FUSED_ROLES[name.rsplit(".", 1)[1]])
                 for name in fused_expert_tensors(spec, layer)]
        if spec.expert_storage != EXPERTS_FUSED:
            _check_mxfp4_dtypes(fused)
        fmt = MXFP4_GROUP32 if spec.expert_storage != EXPERTS_FUSED else None
        for expert in range(spec.num_experts):
            index[layer, expert] = ExpertTensors(tuple(
                ExpertPart(expert_slice(whole, expert), role) for whole, role in fused), fmt)
    return index


def _separate(spec: ModelSpec, stored: Callable[[str], StoredWeight], layer: int,
              expert: int) -> ExpertTensors:
    """gate, up, down (each followed by its scales where quantized)."""
    weights = [stored(name) for name in expert_tensors(spec, layer, expert)]
    if len({weight.fmt for weight in weights}) > 1:
        raise CheckpointError(weights[0].data.file, f"expert {expert} of layer {layer} mixes "
                              f"formats ({', '.join(repr(w.data.name) for w in weights)}: "
                              f"{[w.fmt.describe() if w.fmt else 'plain' for w in weights]}); "
                              "mox pages an expert's three weights in one format")
    parts = []
    for weight, role, scale_role in zip(weights, (GATE, UP, DOWN),
                                        (GATE_SCALE, UP_SCALE, DOWN_SCALE)):
        parts.append(ExpertPart(weight.data, role))
        if weight.scale is not None:
            parts.append(ExpertPart(weight.scale, scale_role))
    return ExpertTensors(tuple(parts), weights[0].fmt)


def expert_slice(info: TensorInfo, expert: int) -> TensorInfo:
    """Index `expert` of an `[E, ...]` tensor: one contiguous byte range."""
    size = info.nbytes // info.shape[0]
    return TensorInfo(info.name, info.file, info.offset + expert * size, size, info.dtype,
                      info.shape[1:])


def _check_mxfp4_dtypes(fused: list[tuple[TensorInfo, str]]) -> None:
    for whole, role in fused:
        if role in MXFP4_ROLES and whole.dtype != torch.uint8:
            raise CheckpointError(whole.file, f"MXFP4 tensor {whole.name!r} is {whole.dtype}, "
                                  "expected U8")

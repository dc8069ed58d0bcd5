"""A model's expert slot pool: `w13 [S, 2I, H]` (gate rows then up rows) and `w2 [S, H, I]`,
with a residency table per MoE layer mapping logical expert -> slot (NOT_RESIDENT = -1).

Until the expert pager exists, `load_all_experts` fills one slot per (layer, expert); the
kernels already read through the slot map, so the pager only changes who fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mox.kernels import NOT_RESIDENT, MoEWorkspace
from mox.loaders import Checkpoint, ExpertTensors


@dataclass
class ExpertPool:
    w13: torch.Tensor          # [S, 2I, H]
    w2: torch.Tensor           # [S, H, I]
    slot_of: torch.Tensor      # [L_moe, E] int32: row m is MoE layer m's residency table
    workspace: MoEWorkspace = field(default_factory=MoEWorkspace)   # kernel scratch, reused

    def slot_map(self, moe_layer: int) -> torch.Tensor:
        return self.slot_of[moe_layer]                      # [E] int32

    def check_integrity(self) -> None:
        """Every slot holds at most one (layer, expert)."""
        used = self.slot_of[self.slot_of != NOT_RESIDENT]
        assert used.unique().numel() == used.numel(), "a slot is mapped twice"
        assert used.numel() == 0 or int(used.max()) < self.w13.shape[0], "slot out of range"


def load_all_experts(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> ExpertPool:
    spec = ckpt.spec
    moe_layers = [i for i, is_moe in enumerate(spec.moe_layers) if is_moe]
    num_slots = len(moe_layers) * spec.num_experts
    hidden, inter = spec.hidden_size, spec.moe_intermediate_size
    pool = ExpertPool(
        w13=torch.empty(num_slots, 2 * inter, hidden, dtype=dtype, device=device),
        w2=torch.empty(num_slots, hidden, inter, dtype=dtype, device=device),
        slot_of=torch.full((len(moe_layers), spec.num_experts), NOT_RESIDENT,
                           dtype=torch.int32, device=device))
    staging = None
    for moe_layer, layer in enumerate(moe_layers):
        for expert in range(spec.num_experts):
            slot = moe_layer * spec.num_experts + expert
            tensors = ckpt.experts[layer, expert]
            staging = staging or _staging_buffers(tensors)
            load_expert(ckpt, tensors, staging, pool, slot)
            pool.slot_of[moe_layer, expert] = slot
    return pool


def _staging_buffers(tensors: ExpertTensors) -> list[torch.Tensor]:
    """Reused host buffers in the checkpoint's dtype: one read per tensor, no allocation."""
    return [torch.empty(info.shape, dtype=info.dtype)
            for info in (tensors.gate, tensors.up, tensors.down)]


def load_expert(ckpt: Checkpoint, tensors: ExpertTensors, staging: list[torch.Tensor],
                pool: ExpertPool, slot: int) -> None:
    inter = pool.w2.shape[2]
    gate, up, down = (ckpt.files.read_into(info, buf)
                      for info, buf in zip((tensors.gate, tensors.up, tensors.down), staging))
    pool.w13[slot, :inter].copy_(gate)
    pool.w13[slot, inter:].copy_(up)
    pool.w2[slot].copy_(down)

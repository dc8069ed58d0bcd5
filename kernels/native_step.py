"""A decode step's layers handed to csrc/decode_layers.c in one call: per layer, its attention
and MoE structs (native_attention.py, native_moe.py), its KV store rows and its row of the
pager's residency table. The table of them is built once per KV store and residency table;
a step checks its own tensors once, not once a layer."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .native_attention import AttentionLayer, check_step
from .native_moe import MoELayer


class StepLayerStruct(ctypes.Structure):
    """decode_layers.c's step_layer_t."""

    _fields_ = [(name, ctypes.c_void_p)
                for name in ("attention", "moe", "keys", "values", "slot_of")]


class StepTailStruct(ctypes.Structure):
    """decode_layers.c's step_tail_t."""

    _fields_ = [("norm", ctypes.c_void_p), ("lm_head", ctypes.c_void_p),
                ("vocab", ctypes.c_int64), ("eps", ctypes.c_float)]


@dataclass(frozen=True)
class StepTail:
    """The model's final norm and lm_head as decode_layers.c runs them after the last layer
    (the tensors kept alive with the struct)."""

    struct: StepTailStruct
    norm: torch.Tensor                  # [H] bf16
    lm_head: torch.Tensor               # [V, H] bf16, rows contiguous


def step_tail(norm: torch.Tensor, lm_head: torch.Tensor, eps: float) -> StepTail | None:
    """The tail for decode_layers, or None where the native norm and GEMV would not serve it
    (the caller then runs it in torch)."""
    if (norm.dtype != torch.bfloat16 or lm_head.dtype != torch.bfloat16 or norm.dim() != 1
            or lm_head.dim() != 2 or lm_head.shape[1] != norm.shape[0]
            or not norm.is_contiguous() or not lm_head.is_contiguous()
            or norm.device.type != "cpu" or lm_head.device.type != "cpu"):
        return None
    return StepTail(StepTailStruct(norm.data_ptr(), lm_head.data_ptr(), lm_head.shape[0], eps),
                    norm, lm_head)


@dataclass(frozen=True)
class StepLayers:
    """The structs' array and the structs it points to (kept alive with it). It points into
    the KV stores without holding them (a store that grows or is released goes): a call
    checks that the store it is handed is the one the table was built over, and its builder
    rebuilds it whenever a store's address changes."""

    array: ctypes.Array
    attention: tuple[AttentionLayer, ...]
    moe: tuple[MoELayer, ...]
    slot_of: torch.Tensor               # [L, E] int32: the residency table (held: its rows)
    store: tuple[int, torch.Size, torch.Size]   # layer 0's keys address; keys, values shapes


def _attention_shape(layer: AttentionLayer) -> tuple:
    s = layer.struct
    return s.hidden, s.heads, s.kv_heads, s.head_dim, s.rotary_dim


def step_layers(attention: list[AttentionLayer], moe: list[MoELayer], moe_rows: list[int],
                stores: list[tuple[torch.Tensor, torch.Tensor]],
                slot_of: torch.Tensor) -> StepLayers:
    """Layer i: `attention[i]`, `moe[i]` (row `moe_rows[i]` of `slot_of [L, E]`) and its
    store's keys and values `[N, h_kv, d]`. The layers must agree on every shape the call
    shares between them (the pools, the routing's k, the store, the rotary tables)."""
    if (slot_of.dtype != torch.int32 or not slot_of.is_contiguous() or slot_of.dim() != 2
            or not moe or not len(attention) == len(moe) == len(moe_rows) == len(stores)
            or any(not 0 <= row < slot_of.shape[0] for row in moe_rows)):
        raise ValueError("decode_layers takes one int32 residency row per layer")
    first, experts = moe[0].struct, slot_of.shape[1]
    keys, values = stores[0]
    for a, m, (k, v) in zip(attention, moe, stores):
        if ((m.struct.hidden, m.struct.inter, m.struct.experts, m.struct.top_k)
                != (first.hidden, first.inter, experts, first.top_k)
                or _attention_shape(a) != _attention_shape(attention[0])
                or a.struct.hidden != first.hidden or k.shape != keys.shape
                or v.shape != values.shape or k.dtype != keys.dtype or v.dtype != values.dtype
                or not k.is_contiguous() or not v.is_contiguous()):
            raise ValueError("decode_layers' layers disagree on their shapes")
    row_bytes = slot_of.stride(0) * slot_of.element_size()
    array = (StepLayerStruct * len(moe))(*(
        StepLayerStruct(ctypes.addressof(a.struct), ctypes.addressof(m.struct), k.data_ptr(),
                        v.data_ptr(), slot_of.data_ptr() + row * row_bytes)
        for a, m, row, (k, v) in zip(attention, moe, moe_rows, stores)))
    return StepLayers(array, tuple(attention), tuple(moe), slot_of,
                      (keys.data_ptr(), keys.shape, values.shape))


def check_layers_step(step: StepLayers, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      indices: list[torch.Tensor]) -> None:
    """This step's tensors against the layers' (the attention block's checks, once; `keys`,
    `values`: layer 0's store, the one the table points into)."""
    if (keys.data_ptr(), keys.shape, values.shape) != step.store:
        raise ValueError("decode_layers' table was built over another KV store")
    check_step(step.attention[0], x, cos, sin, keys, values, indices)
    if h.shape != x.shape or h.dtype != x.dtype or not h.is_contiguous():
        raise ValueError("decode_layers' normed rows must be laid out as its stream")

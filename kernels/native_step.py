"""A decode step's layers handed to csrc/decode_layers.c in one call: per layer, its attention
and MoE structs (native_attention.py, native_moe.py), its KV store rows and its row of the
pager's residency table. The table of them is built once per KV store and residency table;
a batch's decode steps (`DecodeRows`) are checked once, not once a step or a layer, and each
step's call (`DecodeChain`) only passes that step's rows."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
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


@dataclass(frozen=True)
class DecodeRows:
    """A decode batch's steps (one, or several run back to back) as decode_layers.c reads
    them: step j's rotary tables are rows [j * T, (j + 1) * T) of `cos`, `sin` `[N * T, r]`
    float32, its tokens' KV slots and key counts row j of `slot_mapping`, `lengths` `[N, T]`
    int64; every step shares the keys' slots `kv_slots [K]` and each token's first key
    `starts [T]`."""

    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    lengths: torch.Tensor
    kv_slots: torch.Tensor
    starts: torch.Tensor

    @property
    def num_steps(self) -> int:
        return self.slot_mapping.shape[0]

    def step(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step j's cos, sin `[T, r]`, slot mapping and key counts `[T]`."""
        rows = slice(j * self.slot_mapping.shape[1], (j + 1) * self.slot_mapping.shape[1])
        return self.cos[rows], self.sin[rows], self.slot_mapping[j], self.lengths[j]

    def check(self, num_tokens: int) -> None:
        """One row per token and step, each table laid out as its first step's view says
        (which the attention block's checks then answer for every step)."""
        steps = self.num_steps
        if (self.slot_mapping.dim() != 2 or self.slot_mapping.shape[1] != num_tokens
                or self.lengths.shape != self.slot_mapping.shape
                or self.cos.dim() != 2 or self.cos.shape[0] != steps * num_tokens
                or self.sin.shape != self.cos.shape
                or not all(t.is_contiguous() for t in (self.cos, self.sin, self.slot_mapping,
                                                       self.lengths))):
            raise ValueError("decode_layers takes contiguous rows: one per token and step")


class DecodeChain:
    """decode_layers.c's calls for the steps of one `DecodeRows`, every argument checked and
    the outputs allocated once: `chain(first, j)` runs step j's layers from `first` on. The
    outputs (`weights`, `ids`, `logits`) are rewritten by the next call. Checked and laid out
    per step, they had cost 0.13 ms of Python a step at one sequence (2% of a bench step): the
    median time between two calls of a run fell from 0.40-0.45 ms to 0.31-0.34 (`step_ab
    --base bcf2a3f`, bench/results/step_ab-chain-{1,2}.md)."""

    def __init__(self, call: Callable[..., int], layers: ctypes.Array, steps: list[tuple],
                 outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
                 keep: tuple) -> None:
        # (call(layers, first, num_layers, *steps[j]): step j's arguments from the stream on)
        self._call, self._layers, self._steps = call, layers, steps
        self.weights, self.ids, self.logits = outputs
        self.num_layers, self.num_tokens = self.ids.shape[0], self.ids.shape[1]
        self._keep = keep                  # what the pointers point into, kept alive

    def __call__(self, first: int, j: int
                 ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Where step j stopped (every layer, or the first whose experts were not all
        resident), the routing weights and ids, and the logits where every layer ran and the
        chain has a tail (see NativeKernels.decode_chain)."""
        done = self._call(self._layers, first, self.num_layers, *self._steps[j])
        if done == -2:
            raise MemoryError("decode_layers could not allocate its intermediates")
        if done == -3:
            raise RuntimeError(f"decode_layers ran every layer, but its tail (the final norm "
                               f"and lm_head at T={self.num_tokens}) was refused or out of "
                               f"memory")
        if done < 0:
            raise ValueError(f"decode_layers refused T={self.num_tokens} from layer {first} "
                             f"(a slot outside the store, a key run outside the keys, or a "
                             f"layer unlike the others)")
        return done, self.weights, self.ids, (self.logits if done == self.num_layers
                                              else None)

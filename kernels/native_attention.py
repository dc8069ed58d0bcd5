"""How a decoder layer's attention half is handed to the native kernel
(csrc/attention_block.c): the layer's weights as one C struct, built once per layer, and the
checks that keep the C code in bounds."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

# attention_block.c's qk_norm kinds
QK_NORM_KINDS = {"none": 0, "full": 1, "per_head": 2}


class _Layer(ctypes.Structure):
    """attention_block.c's attention_layer_t."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias")] + [
        (name, ctypes.c_int64) for name in (
            "hidden", "heads", "kv_heads", "head_dim", "rotary_dim", "window")] + [
        ("qk_norm", ctypes.c_int), ("interleaved", ctypes.c_int), ("eps", ctypes.c_float),
        ("scale", ctypes.c_float)]


@dataclass(frozen=True)
class AttentionLayer:
    """A layer's struct (its shapes too: `struct.hidden`, ...) and the tensors it points into
    (kept alive with it)."""

    struct: _Layer
    tensors: tuple[torch.Tensor, ...]


def attention_layer(input_norm: torch.Tensor, post_norm: torch.Tensor, qkv: torch.Tensor,
                    o: torch.Tensor, heads: int, kv_heads: int, head_dim: int, rotary_dim: int,
                    interleaved: bool, window: int | None, eps: float, scale: float,
                    qkv_bias: torch.Tensor | None = None, o_bias: torch.Tensor | None = None,
                    qk_norm: str = "none", q_norm: torch.Tensor | None = None,
                    k_norm: torch.Tensor | None = None) -> AttentionLayer:
    """The struct for one layer's weights (bf16, contiguous): `qkv [(h + 2 h_kv) d, H]`,
    `o [H, h d]`, norms `[H]`; `qk_norm` "full" (`q_norm [h d]`, `k_norm [h_kv d]`) or
    "per_head" (both `[d]`)."""
    hidden, width = input_norm.shape[0], (heads + 2 * kv_heads) * head_dim
    norm_widths = {"none": (None, None), "full": (heads * head_dim, kv_heads * head_dim),
                   "per_head": (head_dim, head_dim)}[qk_norm]
    shapes = [(input_norm, (hidden,)), (post_norm, (hidden,)), (qkv, (width, hidden)),
              (o, (hidden, heads * head_dim)), (qkv_bias, (width,)), (o_bias, (hidden,)),
              (q_norm, (norm_widths[0],)), (k_norm, (norm_widths[1],))]
    if (q_norm is None) != (qk_norm == "none") or (k_norm is None) != (qk_norm == "none"):
        raise ValueError(f"attention_block: q/k norm weights must come with qk_norm "
                         f"{qk_norm!r}")
    for tensor, shape in shapes:
        if tensor is not None and (tensor.dtype != torch.bfloat16 or tuple(tensor.shape) != shape
                                   or not tensor.is_contiguous() or tensor.device.type != "cpu"):
            raise ValueError(f"attention_block takes contiguous bf16 CPU weights, got "
                             f"{tuple(tensor.shape)} {tensor.dtype} where {shape} was expected")
    if heads % kv_heads or rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise ValueError(f"attention_block: {heads} heads over {kv_heads} KV heads, rotary "
                         f"dim {rotary_dim} of {head_dim}")
    def pointer(t):
        return None if t is None else t.data_ptr()
    struct = _Layer(*(pointer(t) for t, _ in shapes[:2]), pointer(qkv), pointer(qkv_bias),
                    pointer(q_norm), pointer(k_norm), pointer(o), pointer(o_bias), hidden,
                    heads, kv_heads, head_dim, rotary_dim, window or 0, QK_NORM_KINDS[qk_norm],
                    int(interleaved), eps, scale)
    return AttentionLayer(struct, tuple(t for t, _ in shapes if t is not None))


def check_step(layer: AttentionLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, indices: list[torch.Tensor]) -> None:
    """The step's tensors must be as the C code reads them: a mismatch would read or write
    out of bounds, so it raises here (the values of the index tensors, slots in the store and
    key runs in `kv_slots`, the C code checks itself). `indices`: slot_mapping, starts,
    lengths `[T]` and the keys' slots."""
    num_tokens, shape = x.shape[0], layer.struct
    store = (shape.kv_heads, shape.head_dim)
    if (x.dim() != 2 or x.shape[1] != shape.hidden or x.dtype != torch.bfloat16
            or not x.is_contiguous() or keys.shape[1:] != store or values.shape != keys.shape
            or keys.dtype != torch.bfloat16 or values.dtype != torch.bfloat16
            or not keys.is_contiguous() or not values.is_contiguous()):
        raise ValueError("attention_block's rows, keys and values disagree with its layer")
    for table in (cos, sin):
        if (table.dtype != torch.float32 or table.shape != (num_tokens, shape.rotary_dim)
                or not table.is_contiguous()):
            raise ValueError("attention_block takes float32 cos, sin [T, rotary_dim]")
    if any(t.dtype != torch.int64 or not t.is_contiguous() or t.dim() != 1 for t in indices) or any(
            t.shape[0] != num_tokens for t in indices[:3]):
        raise ValueError("attention_block takes int64 slots, starts and lengths, one per token")

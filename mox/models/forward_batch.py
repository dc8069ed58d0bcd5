"""What one forward pass over a flattened batch of sequences needs to know (the attention
metadata), built by the engine's runner. All sequences belong to one model.

Legend: T new tokens (all sequences, flattened), K visible keys (every batched sequence's
cached + new tokens, concatenated), S sampled sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mox.kernels.native_step import DecodeRows
from mox.models.kv_store import KVAnchor, KVStore
from mox.models.rotary import Rotary


@dataclass
class PaddedLayout:
    """The same batch as B padded rows, for per-sequence attention: cheaper than the flat
    block-diagonal mask when many sequences decode (cost B x Tq x Pk instead of T x K).
    Legend: B sequences, Tq / Pk the most new tokens / keys of any one of them."""

    q_index: torch.Tensor            # [B, Tq] flat token index (padding: 0)
    q_valid: torch.Tensor            # [B, Tq] bool
    q_pos: torch.Tensor              # [B, Tq] positions
    kv_slots: torch.Tensor           # [B, Pk] flat KV slots (padding: 0)
    kv_pos: torch.Tensor             # [B, Pk] positions (padding: beyond any query)
    _memo: dict = field(default_factory=dict, repr=False)

    def mask(self, window: int | None) -> torch.Tensor:
        """`[B, Tq, Pk]` bool; padding queries see key 0, so no row is empty (NaN)."""
        mask = self._memo.get(window)
        if mask is None:
            distance = self.q_pos[:, :, None] - self.kv_pos[:, None, :]      # [B, Tq, Pk]
            mask = distance >= 0
            if window is not None:
                mask &= distance < window
            mask[:, :, 0] |= ~self.q_valid
            self._memo[window] = mask
        return mask


@dataclass
class DecodeAhead:
    """A decode batch's steps run back to back (multi-step decode, mox.engine.scheduler),
    step 0 the batch itself: step j's token of sequence s sits at `positions[j, s]`, its K/V
    goes to `slot_mapping[j, s]`, and it attends to `kv_slots[starts[s] : starts[s] +
    positions[j, s] + 1]` (each sequence's keys one run, as far as its last step reaches)."""

    positions: torch.Tensor          # [N, S]
    slot_mapping: torch.Tensor       # [N, S]
    kv_slots: torch.Tensor           # [K'] every key of the last step
    starts: torch.Tensor             # [S]
    max_position: int                # largest entry of `positions` (host int)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor          # [T] token ids
    positions: torch.Tensor          # [T] position of each token in its sequence
    q_seq: torch.Tensor              # [T] which batched sequence each token belongs to
    slot_mapping: torch.Tensor       # [T] flat KV slot each new token's K/V goes to
    kv_slots: torch.Tensor           # [K] flat KV slots of every key the batch attends to
    kv_seq: torch.Tensor             # [K] sequence of each key
    kv_pos: torch.Tensor             # [K] position of each key
    kv: KVStore
    logits_indices: torch.Tensor | None = None   # [S] tokens whose logits are wanted
    max_position: int = 0                         # largest entry of `positions` (host int)
    # set when per-sequence attention is cheaper (or its builder: decode attention that reads
    # the store in place never needs it, so it is built on first use)
    padded: PaddedLayout | Callable[[], PaddedLayout | None] | None = None
    # (starts, lengths) `[T]`: each token's keys in `kv_slots`, set when every sequence brings
    # one new token (decode), whose keys are then one run each
    key_ranges: tuple[torch.Tensor, torch.Tensor] | None = None
    ahead: DecodeAhead | None = None         # set when the batch runs several decode steps
    # (graphs) the store as the Triton kernels address it from fixed anchors: `kv_rows`
    kv_anchor: KVAnchor | None = None
    _memo: dict = field(default_factory=dict, repr=False)   # per-batch memo: masks, rotary

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def kv_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layer's keys `[N, h_kv, d]` and values `[N, h_kv, dv]` for the Triton kernels,
        and None; or, with `kv_anchor`, the anchors and the layer's offsets `[2]` from them."""
        if self.kv_anchor is None:
            return *self.kv.rows(layer), None
        anchor = self.kv_anchor
        return anchor.keys, anchor.values, anchor.offsets[layer]

    def padded_layout(self) -> PaddedLayout | None:
        """The per-sequence layout, if this batch has one (built now if it was deferred)."""
        if callable(self.padded):
            self.padded = self.padded()
        return self.padded

    def rotary_tables(self, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos/sin of this batch's positions, computed once for all layers."""
        tables = self._memo.get("rotary")
        if tables is None:
            tables = self._memo["rotary"] = rotary.tables(self.positions, self.max_position)
        return tables

    def decode_rows(self, rotary: Rotary) -> DecodeRows:
        """A decode batch's steps (one, or `ahead`'s) as the native calls read them."""
        starts, lengths = self.key_ranges
        ahead = self.ahead
        if ahead is None:
            cos, sin = (t.reshape(t.shape[0], -1) for t in self.rotary_tables(rotary))
            return DecodeRows(cos, sin, self.slot_mapping[None], lengths[None], self.kv_slots,
                              starts)
        cos, sin = (t.reshape(t.shape[0], -1) for t in rotary.tables(ahead.positions.flatten(),
                                                                     ahead.max_position))
        return DecodeRows(cos, sin, ahead.slot_mapping, ahead.positions + 1, ahead.kv_slots,
                          ahead.starts)

    def attention_mask(self, window: int | None) -> torch.Tensor | None:
        """`[T, K]` bool: a token sees its own sequence's keys at or before its position
        (and within the sliding window); built once per window size per batch. None when it
        would be all True: one sequence decoding one token, inside any window."""
        if self.num_tokens == 1 and (window is None or self.max_position < window):
            return None
        mask = self._memo.get(window)
        if mask is None:
            distance = self.positions[:, None] - self.kv_pos[None, :]           # [T, K]
            mask = (self.q_seq[:, None] == self.kv_seq[None, :]) & (distance >= 0)
            if window is not None:
                mask &= distance < window
            self._memo[window] = mask
        return mask

"""One sequence's KV cache on a private paged store: the convenience path for running a
single sequence outside the engine (tests, tools). Slot p holds position p."""

from __future__ import annotations

import torch

from mox.models.forward_batch import ForwardBatch
from mox.models.kv_store import KVStore

SEQUENCE_BLOCK_SIZE = 64


class SequenceKVCache:
    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.num_tokens = 0           # positions [0, num_tokens) hold valid K/V

    def batch_for(self, input_ids: torch.Tensor) -> ForwardBatch:
        """The next `input_ids` `[T]` as a one-sequence batch; all their logits wanted."""
        start, end = self.num_tokens, self.num_tokens + input_ids.numel()
        self.store.ensure_blocks(-(-end // self.store.block_size))
        device = self.store.device
        new = torch.arange(start, end, device=device)                         # [T]
        seen = torch.arange(end, device=device)                               # [K]
        self.num_tokens = end
        return ForwardBatch(
            input_ids=input_ids.to(device), positions=new,
            q_seq=torch.zeros_like(new), slot_mapping=new, kv_slots=seen,
            kv_seq=torch.zeros_like(seen), kv_pos=seen, kv=self.store, max_position=end - 1)

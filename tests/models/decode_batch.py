"""A decode batch over a real KV store for the native-block tests: three sequences prefilled
one by one into one store, then one decode step of them, each token's keys one run."""

from __future__ import annotations

import torch

from mox.models.forward_batch import ForwardBatch

PROMPTS = (3, 9, 5)          # tokens per sequence (past the sliding window of 6 in one)
SEQ_SLOTS = 32               # each sequence's slots start at a multiple of this


def decode_batch(model, gen: torch.Generator) -> ForwardBatch:
    """Three sequences prefilled one by one into one store, then one decode batch of them."""
    store = model.new_kv_store(block_size=8)
    blocks = len(PROMPTS) * SEQ_SLOTS // 8
    store.ensure_blocks(blocks, max_blocks=4 * blocks)   # (on the CPU: mapped for 4x)
    vocab = model.spec.vocab_size
    for i, n in enumerate(PROMPTS):
        slots = torch.arange(n) + i * SEQ_SLOTS
        prefill = ForwardBatch(torch.randint(0, vocab, (n,), generator=gen), torch.arange(n),
                               torch.zeros(n, dtype=torch.long), slots, slots,
                               torch.zeros(n, dtype=torch.long), torch.arange(n), store,
                               max_position=n - 1)
        model.forward_batch(prefill)
    lengths = torch.tensor(PROMPTS) + 1
    kv_slots = torch.cat([torch.arange(n) + i * SEQ_SLOTS for i, n in enumerate(lengths)])
    batch = ForwardBatch(
        torch.randint(0, vocab, (len(PROMPTS),), generator=gen), torch.tensor(PROMPTS),
        torch.arange(len(PROMPTS)), torch.tensor(PROMPTS) + torch.arange(3) * SEQ_SLOTS,
        kv_slots, torch.repeat_interleave(torch.arange(3), lengths),
        torch.cat([torch.arange(n) for n in lengths]), store,
        max_position=max(PROMPTS))
    batch.key_ranges = lengths.cumsum(0) - lengths, lengths
    return batch

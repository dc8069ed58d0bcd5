"""The model runner: a scheduled `Batch` -> one flattened `ForwardBatch` -> logits of the
sequences that reach their last token -> sampled tokens.

Legend: T new tokens in the step, K keys the step attends to, S sequences that sample.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass
from functools import partial

import torch

from mox.engine.scheduler import Batch
from mox.engine.sequence import Sequence
from mox.models import MoEDecoder
from mox.models.forward_batch import ForwardBatch, PaddedLayout
from mox.models.kv_store import KVStore
from mox.pager import ReadsPending
from mox.sampling import greedy_tokens, sample

PAD_POSITION = 1 << 40      # a padding key's position: after every query, so always masked


@dataclass(frozen=True)
class SampledToken:
    seq: Sequence
    token_id: int
    logprob: float | None


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class ModelRunner:
    def __init__(self, model: MoEDecoder, kv: KVStore) -> None:
        self.model = model
        self.kv = kv

    def build(self, batch: Batch) -> ForwardBatch:
        bs = self.kv.block_size
        ids, pos, q_seq, new_slots, kv_slots, kv_seq, kv_pos, sample_at = ([] for _ in range(8))
        for i, item in enumerate(batch.sequences):
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            ids += seq.token_ids(start, end)
            pos += range(start, end)
            q_seq += [i] * item.num_new_tokens
            new_slots += _slots(seq.block_table, start, end, bs)
            kv_slots += _slots(seq.block_table, 0, end, bs)
            kv_seq += [i] * end
            kv_pos += range(end)
            if item.samples:
                sample_at.append(len(ids) - 1)
        lists = [ids, pos, q_seq, new_slots, kv_slots, kv_seq, kv_pos, sample_at]
        decode = len(ids) == len(batch.sequences)            # one new token each
        if decode:                      # each token's keys: one run of kv_slots
            lengths = [item.seq.num_computed_tokens + 1 for item in batch.sequences]
            lists += [list(itertools.accumulate(lengths[:-1], initial=0)), lengths]
        # one tensor for them all, split into views: a torch.tensor call costs more than
        # a decode step's lists take to fill
        flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long,
                            device=self.model.device).split([len(values) for values in lists])
        # (every token sampled, as in decode: no gather of the rows before the lm_head)
        forward = ForwardBatch(*flat[:7], self.kv, max_position=max(pos),
                               logits_indices=None if len(sample_at) == len(ids) else flat[7])
        forward.padded = partial(self._padded_layout, batch, len(ids), len(kv_slots))
        if decode:
            forward.key_ranges = flat[8], flat[9]
        return forward

    def _padded_layout(self, batch: Batch, num_tokens: int, num_keys: int) -> PaddedLayout | None:
        """Per-sequence rows, when that attends over fewer (query, key) pairs than the flat
        block-diagonal layout (many decodes: B x 1 x P instead of B x B x P)."""
        items = batch.sequences
        max_new = max(item.num_new_tokens for item in items)
        ends = [item.seq.num_computed_tokens + item.num_new_tokens for item in items]
        if len(items) < 2 or len(items) * max_new * max(ends) >= num_tokens * num_keys:
            return None
        bs, first = self.kv.block_size, 0
        q_index, q_pos, kv_slots, kv_pos = [], [], [], []
        for item, end in zip(items, ends):
            start = end - item.num_new_tokens
            pad_q, pad_k = max_new - item.num_new_tokens, max(ends) - end
            q_index.append(list(range(first, first + item.num_new_tokens)) + [0] * pad_q)
            q_pos.append(list(range(start, end)) + [0] * pad_q)
            kv_slots.append(_slots(item.seq.block_table, 0, end, bs) + [0] * pad_k)
            kv_pos.append(list(range(end)) + [PAD_POSITION] * pad_k)
            first += item.num_new_tokens
        device = self.model.device
        q_index_t = torch.tensor(q_index, dtype=torch.long, device=device)
        valid = torch.tensor([[j < item.num_new_tokens for j in range(max_new)]
                              for item in items], device=device)
        return PaddedLayout(q_index_t, valid,
                            torch.tensor(q_pos, dtype=torch.long, device=device),
                            torch.tensor(kv_slots, dtype=torch.long, device=device),
                            torch.tensor(kv_pos, dtype=torch.long, device=device))

    def steps(self, batch: Batch) -> Generator[ReadsPending | None, None, list[SampledToken]]:
        """Run the batch and sample; yields at the forward pass's layer boundaries and where
        it waits for expert reads (see mox.engine.in_flight)."""
        forward = self.build(batch)
        logits = yield from self.model.forward_steps(forward)             # [S, V]
        sampling = [item.seq for item in batch.sequences if item.samples]
        for item in batch.sequences:
            item.seq.num_computed_tokens += item.num_new_tokens
        # greedy rows in one argmax over the batch (one op, not one per sequence)
        greedy = (greedy_tokens(logits) if any(seq.params.is_greedy for seq in sampling)
                  else [])
        out = []
        for i, (row, seq) in enumerate(zip(logits, sampling)):
            token = greedy[i] if seq.params.is_greedy else sample(row, seq.params,
                                                                   seq.generator)
            logprob = (float(torch.log_softmax(row, dim=-1)[token]) if seq.params.logprobs
                       else None)
            out.append(SampledToken(seq, token, logprob))
        return out

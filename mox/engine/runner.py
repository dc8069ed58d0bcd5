"""The model runner: a scheduled `Batch` -> one flattened `ForwardBatch` -> logits of the
sequences that reach their last token -> sampled tokens.

Legend: T new tokens in the step, K keys the step attends to, S sequences that sample.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from mox.engine.scheduler import Batch
from mox.engine.sequence import Sequence
from mox.models import MoEDecoder
from mox.models.forward_batch import DecodeAhead, ForwardBatch, PaddedLayout
from mox.models.kv_store import KVStore
from mox.pager import ReadsPending
from mox.sampling import NaNLogitsError, greedy_tokens, nan_rows, sample

PAD_POSITION = 1 << 40      # a padding key's position: after every query, so always masked


@dataclass(frozen=True)
class SampledToken:
    seq: Sequence
    token_id: int
    logprob: float | None
    nan: bool = False       # the row's logits were NaN: the sequence fails, the batch goes on


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _key_slots(tables: list[list[int]], ends: list[int], block_size: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Every key of sequences whose block tables are `tables`, `ends` keys each, concatenated:
    its KV slot, its sequence, its position; and each sequence's first key's index."""
    # (else a sequence's keys would run into the next one's blocks)
    assert all(len(table) * block_size >= end for table, end in zip(tables, ends)), \
        "a sequence's block table is shorter than its tokens"
    blocks = np.fromiter(itertools.chain.from_iterable(tables), np.int64)
    seq_of_key = np.repeat(np.arange(len(tables)), ends)
    first_key = list(itertools.accumulate(ends[:-1], initial=0))
    key_pos = np.arange(len(seq_of_key)) - np.repeat(first_key, ends)
    first_block = list(itertools.accumulate((len(t) for t in tables[:-1]), initial=0))
    kv_slots = (blocks[:, None] * block_size + np.arange(block_size)).ravel()[
        key_pos + np.repeat(np.array(first_block) * block_size, ends)]
    return kv_slots, seq_of_key, key_pos, first_key


class ModelRunner:
    def __init__(self, model: MoEDecoder, kv: KVStore) -> None:
        self.model = model
        self.kv = kv

    def build(self, batch: Batch, steps: int = 1) -> ForwardBatch:
        """The batch's index tensors, built in numpy with no loop over keys: a sequence's keys
        are O(context) each step (slot, position and sequence of every key), which Python
        lists paid ~0.1 us an entry for (0.8 ms a step at 2,000 tokens). A decode batch run
        `steps` > 1 steps back to back also gets its later steps' slots (`ahead`)."""
        items, bs = batch.sequences, self.kv.block_size
        starts = [item.seq.num_computed_tokens for item in items]
        counts = [item.num_new_tokens for item in items]
        ends = [start + count for start, count in zip(starts, counts)]
        tables = [item.seq.block_table for item in items]
        ids = list(itertools.chain.from_iterable(
            item.seq.token_ids(start, end) for item, start, end in zip(items, starts, ends)))
        kv_slots, seq_of_key, key_pos, first_key = _key_slots(tables, ends, bs)
        # per new token: its sequence and position
        q_seq = np.repeat(np.arange(len(items)), counts)
        first_new = list(itertools.accumulate(counts[:-1], initial=0))
        positions = np.arange(len(ids)) + np.repeat(
            [start - first for start, first in zip(starts, first_new)], counts)
        sample_at = np.array([first + count - 1 for first, count, item
                              in zip(first_new, counts, items) if item.samples], np.int64)
        arrays = [np.asarray(ids, dtype=np.int64), positions, q_seq,
                  kv_slots[np.repeat(first_key, counts) + positions], kv_slots, seq_of_key,
                  key_pos, sample_at]
        decode = len(ids) == len(items)                        # one new token each
        if decode:                      # each token's keys: one run of kv_slots
            arrays += [np.asarray(first_key), np.asarray(ends)]
        ahead = decode and steps > 1
        if ahead:                       # the last step's keys; each step's positions, slots
            last_slots, _, _, last_first = _key_slots(tables, [end + steps - 1 for end in ends],
                                                      bs)
            step_pos = np.asarray(starts)[None, :] + np.arange(steps)[:, None]       # [N, S]
            arrays += [last_slots, np.asarray(last_first), step_pos.ravel(),
                       last_slots[np.asarray(last_first)[None, :] + step_pos].ravel()]
        # one tensor for them all, split into views
        flat = torch.from_numpy(np.concatenate(arrays)).to(self.model.device).split(
            [len(a) for a in arrays])
        # (every token sampled, as in decode: no gather of the rows before the lm_head)
        forward = ForwardBatch(*flat[:7], self.kv, max_position=max(ends) - 1,
                               logits_indices=None if len(sample_at) == len(ids) else flat[7])
        forward.padded = partial(self._padded_layout, batch, len(ids), len(kv_slots))
        if decode:
            forward.key_ranges = flat[8], flat[9]
        if ahead:
            forward.ahead = DecodeAhead(flat[12].view(steps, -1), flat[13].view(steps, -1),
                                        flat[10], flat[11], max(ends) + steps - 2)
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

    def steps(self, batch: Batch, interrupt: Callable[[], bool]
              ) -> Generator[ReadsPending | None, None, list[list[SampledToken]]]:
        """Run the batch and sample: its sampled tokens, a list per step (one step, or up
        to `batch.num_steps` decode steps back to back, which end early where a sequence
        samples a stop token or after a step where `interrupt()` says something waits).
        Yields at the forward pass's layer boundaries and where it waits for expert reads
        (see mox.engine.in_flight)."""
        context = self.model.spec.max_position_embeddings
        # (a step past the context would sample a token the engine drops)
        steps = max(1, min(batch.num_steps,
                           context - max(item.seq.num_tokens for item in batch.sequences)))
        forward = self.build(batch, steps)
        sampling = [item.seq for item in batch.sequences if item.samples]
        sampled: list[list[SampledToken]] = []

        def pick(logits: torch.Tensor) -> torch.Tensor | None:        # logits [S, V]
            for item in batch.sequences:
                item.seq.num_computed_tokens += item.num_new_tokens
            sampled.append(self._sample(sampling, logits))
            if (len(sampled) == steps or any(s.nan or s.seq.params.is_stop_token(s.token_id)
                                             for s in sampled[-1]) or interrupt()):
                return None
            return torch.tensor([s.token_id for s in sampled[-1]], device=logits.device)

        yield from self.model.decode_steps(forward, pick)
        return sampled

    @staticmethod
    def _sample(sampling: list[Sequence], logits: torch.Tensor) -> list[SampledToken]:
        """A token for each sequence from its row of `logits [S, V]`; a row of NaN logits
        gives a token marked `nan` (its sequence fails; the others' go on)."""
        # greedy rows in one argmax over the batch (one op, not one per sequence)
        greedy = (greedy_tokens(logits) if any(seq.params.is_greedy for seq in sampling)
                  else [])
        nans = nan_rows(logits, greedy) if greedy else []
        out = []
        # (a row taken only where a sequence samples or wants logprobs: iterating the tensor
        # made a view per row, and greedy sampling at one sequence took 88 us, now 61)
        for i, seq in enumerate(sampling):
            params = seq.params
            if params.is_greedy:
                token, nan = greedy[i], nans[i]
            else:
                try:
                    token, nan = sample(logits[i], params, seq.generator), False
                except NaNLogitsError:
                    token, nan = 0, True
            logprob = (float(torch.log_softmax(logits[i], dim=-1)[token])
                       if params.logprobs and not nan else None)
            out.append(SampledToken(seq, token, logprob, nan))
        return out

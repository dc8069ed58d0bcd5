"""The model runner: a scheduled `Batch` -> one flattened `ForwardBatch` -> logits of the
sequences that reach their last token -> sampled tokens.

Legend: T new tokens in the step, K keys the step attends to, S sequences that sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mox.engine.scheduler import Batch
from mox.engine.sequence import Sequence
from mox.models import MoEDecoder
from mox.models.forward_batch import ForwardBatch
from mox.models.kv_store import KVStore
from mox.sampling import sample


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
        device = self.model.device

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return ForwardBatch(tensor(ids), tensor(pos), tensor(q_seq), tensor(new_slots),
                            tensor(kv_slots), tensor(kv_seq), tensor(kv_pos), self.kv,
                            logits_indices=tensor(sample_at), max_position=max(pos))

    def run(self, batch: Batch) -> list[SampledToken]:
        forward = self.build(batch)
        logits = self.model.forward_batch(forward)                        # [S, V]
        sampling = [item.seq for item in batch.sequences if item.samples]
        for item in batch.sequences:
            item.seq.num_computed_tokens += item.num_new_tokens
        out = []
        for row, seq in zip(logits, sampling):
            token = sample(row, seq.params, seq.generator)
            logprob = (float(torch.log_softmax(row, dim=-1)[token]) if seq.params.logprobs
                       else None)
            out.append(SampledToken(seq, token, logprob))
        return out

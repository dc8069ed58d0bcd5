"""The runner's index tensors (ModelRunner.build, in numpy) against their definition written
out token by token and key by key: chunked prefill, decode, spare blocks, rows that do not
sample."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mox.engine.runner import ModelRunner
from mox.engine.scheduler import Batch, ScheduledSequence
from mox.engine.sequence import Sequence
from mox.messages import Request
from mox.sampling import SamplingParams

BLOCK = 4


def _batch(shapes: list[tuple[int, int, int, int, int]]) -> Batch:
    """(prompt tokens, output tokens, tokens computed, new tokens this step, spare blocks) a
    sequence; block numbers handed out in reverse, so no sequence's blocks are in order or
    adjacent."""
    items, next_block = [], 1000
    for i, (prompt, outputs, computed, new, spare) in enumerate(shapes):
        seq = Sequence(Request(f"r{i}", "m", list(range(10 * i, 10 * i + prompt)),
                               SamplingParams(8)), torch.Generator())
        seq.output_token_ids = list(range(500 + i, 500 + i + outputs))
        seq.num_computed_tokens = computed
        blocks = -(-(computed + new) // BLOCK) + spare
        seq.block_table = list(range(next_block, next_block - 3 * blocks, -3))
        next_block -= 3 * blocks + 7
        items.append(ScheduledSequence(seq, new))
    return Batch("m", items)


def _expected(batch: Batch) -> dict[str, list[int]]:
    """Every index as the runner's docstrings define it, one token and one key at a time."""
    out = {k: [] for k in ("ids", "pos", "q_seq", "slot", "kv_slots", "kv_seq", "kv_pos",
                           "sample_at", "starts", "lengths")}
    slot = lambda seq, p: seq.block_table[p // BLOCK] * BLOCK + p % BLOCK    # noqa: E731
    for i, item in enumerate(batch.sequences):
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        out["starts"].append(len(out["kv_slots"]))
        out["lengths"].append(end)
        for p in range(start, end):
            out["ids"].append(seq.token_ids(p, p + 1)[0])
            out["pos"].append(p)
            out["q_seq"].append(i)
            out["slot"].append(slot(seq, p))
        for p in range(end):
            out["kv_slots"].append(slot(seq, p))
            out["kv_seq"].append(i)
            out["kv_pos"].append(p)
        if item.samples:
            out["sample_at"].append(len(out["ids"]) - 1)
    return out


def _build(batch: Batch):
    model = SimpleNamespace(device=torch.device("cpu"))
    return ModelRunner(model, SimpleNamespace(block_size=BLOCK)).build(batch)


@st.composite
def shapes(draw) -> tuple[int, int, int, int, int]:
    """A sequence mid-prefill (a chunk of its prompt) or decoding (its last token new)."""
    prompt, outputs = draw(st.integers(1, 20)), draw(st.integers(0, 3))
    total = prompt + outputs
    computed = total - 1 if outputs else draw(st.integers(0, prompt - 1))
    return prompt, outputs, computed, draw(st.integers(1, total - computed)), \
        draw(st.integers(0, 2))


@settings(max_examples=80, deadline=None)
@given(st.lists(shapes(), min_size=1, max_size=5))
def test_index_tensors_follow_their_definition(shapes):
    batch = _batch(shapes)
    forward, want = _build(batch), _expected(batch)
    got = {"ids": forward.input_ids, "pos": forward.positions, "q_seq": forward.q_seq,
           "slot": forward.slot_mapping, "kv_slots": forward.kv_slots,
           "kv_seq": forward.kv_seq, "kv_pos": forward.kv_pos}
    for name, tensor in got.items():
        assert tensor.dtype == torch.long and tensor.tolist() == want[name], name
    assert forward.max_position == max(want["pos"])
    every_row = len(want["sample_at"]) == len(want["ids"])
    assert (forward.logits_indices is None if every_row
            else forward.logits_indices.tolist() == want["sample_at"])
    if all(item.num_new_tokens == 1 for item in batch.sequences):        # decode
        starts, lengths = forward.key_ranges
        assert starts.tolist() == want["starts"] and lengths.tolist() == want["lengths"]
    else:
        assert forward.key_ranges is None


def test_a_block_table_too_short_for_its_tokens_is_refused():
    """A sequence whose blocks do not cover its tokens would write into another's keys."""
    batch = _batch([(9, 0, 0, 9, 0), (5, 0, 0, 5, 0)])
    batch.sequences[0].seq.block_table.pop()
    with pytest.raises(AssertionError, match="block"):
        _build(batch)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 3)), min_size=1, max_size=5),
       st.integers(2, 6))
def test_later_decode_steps_follow_their_definition(seqs, steps):
    """A decode batch run `steps` steps back to back (its blocks reserved for all of them):
    each step's position and slot of every sequence's token, and its keys one run."""
    shapes = []
    for prompt, outputs in seqs:
        computed = prompt + outputs - 1
        spare = -(-(computed + steps) // BLOCK) - -(-(computed + 1) // BLOCK)
        shapes.append((prompt, outputs, computed, 1, spare))
    batch = _batch(shapes)
    forward = ModelRunner(SimpleNamespace(device=torch.device("cpu")),
                          SimpleNamespace(block_size=BLOCK)).build(batch, steps)
    ahead = forward.ahead
    slot = lambda seq, p: seq.block_table[p // BLOCK] * BLOCK + p % BLOCK    # noqa: E731
    assert ahead.positions.shape == ahead.slot_mapping.shape == (steps, len(seqs))
    for s, item in enumerate(batch.sequences):
        start = int(ahead.starts[s])
        for j in range(steps):
            p = item.seq.num_computed_tokens + j
            assert int(ahead.positions[j, s]) == p
            assert int(ahead.slot_mapping[j, s]) == slot(item.seq, p)
            assert ahead.kv_slots[start:start + p + 1].tolist() == [
                slot(item.seq, q) for q in range(p + 1)]
    assert ahead.max_position == int(ahead.positions.max())
    assert ahead.positions[0].tolist() == forward.positions.tolist()      # step 0: the batch
    assert ahead.slot_mapping[0].tolist() == forward.slot_mapping.tolist()


def test_a_batch_with_a_prompt_plans_no_later_steps():
    batch = _batch([(5, 2, 6, 1, 1), (6, 0, 0, 6, 1)])
    forward = ModelRunner(SimpleNamespace(device=torch.device("cpu")),
                          SimpleNamespace(block_size=BLOCK)).build(batch, 3)
    assert forward.ahead is None

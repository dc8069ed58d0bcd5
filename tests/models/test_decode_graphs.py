"""Decode steps replayed as graphs (issue 20), checked on the CPU through `EagerCapture`: the
padding to capture sizes, the static buffers and the bookkeeping of what a graph bakes in.
The step is the GPU's: experts through the pager's table (a quarter in slots, the rest read
in place from the host cache) and attention through the Triton decode kernel, both under the
interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mox import LLM
from mox.bench.micro.step_ops import kernel_launches
from mox.kernels import triton_ops
from mox.models.decode_graphs import CAPTURE_SIZES, EagerCapture, capture_size
from tests.models.decode_batch import decode_batch


@pytest.fixture()
def model(mapped_mixtral, monkeypatch):
    monkeypatch.setattr(triton_ops, "takes", lambda x: True)     # the GPU's attention
    pool = mapped_mixtral.experts
    pool.maps_host_experts = True
    return mapped_mixtral


def _store(batch) -> list[torch.Tensor]:
    return [t.clone() for t in (*batch.kv.keys, *batch.kv.values)]


def _captures(pool) -> int:
    return pool.stats()["graph_captures"]


def _used(pool) -> int:
    """Experts counted as used by steps so far (hits in slots and reads in place)."""
    stats = pool.stats()
    return stats["hits"] + stats["mapped_reads"]


def test_capture_sizes_cover_each_batch_with_the_least_padding():
    for n in range(1, CAPTURE_SIZES[-1] + 1):
        size = capture_size(n)
        assert size >= n and size in CAPTURE_SIZES
        assert all(s < n for s in CAPTURE_SIZES if s < size)
    assert capture_size(CAPTURE_SIZES[-1] + 1) is None


def test_a_replayed_step_equals_the_eager_one_and_touches_only_its_own_rows(model):
    pool = model.experts
    batch = decode_batch(model, torch.Generator().manual_seed(5))      # 3 sequences
    before, used = _store(batch), _used(pool)
    want = model.forward_batch(batch)
    eager_used = _used(pool) - used
    assert eager_used > 0
    eager_store = _store(batch)

    model.use_graphs(CheckedCapture())
    for _ in range(2):
        used, captures = _used(pool), _captures(pool)
        got = model.forward_batch(batch)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert got.shape == want.shape                     # the padding row not returned
        # the padding row repeats row 0: it marks no expert the batch did not route to
        assert _used(pool) - used == eager_used
    assert model.graphs.sizes == [4]                       # 3 rows padded to 4
    assert _captures(pool) == captures                     # the second step replayed
    # the padding row wrote row 0's K/V to row 0's slot: the store is as the eager step left it
    for t, eager, old in zip(_store(batch), eager_store, before):
        torch.testing.assert_close(t, eager, atol=1e-5, rtol=1e-5)
        changed = (t != old).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(changed) <= set(batch.slot_mapping.tolist())
    assert pool.slot_pool.holds == 0
    pool.check_integrity()


class CheckedCapture(EagerCapture):
    """EagerCapture that also holds each replay to what a real graph does: read the tensors
    the captured step read, where they were (the addresses of every tensor an op or a Triton
    launch is handed that the step did not make)."""

    def capture(self, step):
        want = _addresses_read(step)[1]

        def replay():
            out, got = _addresses_read(step)
            assert got == want, "a replay reads tensors the captured step did not"
            return out
        return replay


def _addresses_read(step) -> tuple[torch.Tensor, set[int]]:
    """The step's output, and the addresses of the tensors its ops and Triton launches were
    handed that it did not make."""
    made: set[int] = set()
    read: set[int] = set()

    def note(name: str, args: tuple, out: object) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and a.numel() and a.data_ptr() not in made:
                read.add(a.data_ptr())
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel():
                made.add(t.data_ptr())

    with kernel_launches(note):
        out = step()
    return out, read


def _captured(model):
    """A decode batch, its eager logits, and the captures once its step was captured under
    CheckedCapture."""
    batch = decode_batch(model, torch.Generator().manual_seed(7))
    want = model.forward_batch(batch)
    model.use_graphs(CheckedCapture())
    model.forward_batch(batch)
    return batch, want, _captures(model.experts)


def test_a_replay_follows_the_kv_store_where_it_moved(model):
    """The KV store moves (grown, released and allocated again) without a capture: the
    replay reads it through the anchors, at the store's new place."""
    pool = model.experts
    batch, want, captures = _captured(model)
    kv = batch.kv
    old = kv.keys + kv.values
    kv.keys, kv.values = [t.clone() for t in kv.keys], [t.clone() for t in kv.values]
    for t in old:                                  # a read of the old place is wrong
        t.fill_(float("nan"))
    torch.testing.assert_close(model.forward_batch(batch), want, atol=1e-4, rtol=1e-4)
    assert _captures(pool) == captures


def test_moved_pools_recapture_and_parking_drops_the_graphs(model):
    pool = model.experts
    batch, want, captures = _captured(model)
    model.forward_batch(batch)
    assert _captures(pool) == captures                     # nothing moved: replayed
    pool.resize(pool.max_slots)                            # the pools grew
    pool.wait_for_loads()
    torch.testing.assert_close(model.forward_batch(batch), want, atol=1e-4, rtol=1e-4)
    assert _captures(pool) == captures + 1
    assert pool.stats()["graph_capture_seconds"] > 0
    model.drop_graphs()
    assert model.graphs.sizes == []


def _table_llm(path: str) -> LLM:
    """An fp32 LLM whose decode steps take the table path (misses read from the host cache),
    running decode steps back to back in runs of any length (the interpreter's steps are
    slow, and `decode_run_s` counts time)."""
    llm = LLM(path, dtype=torch.float32, kv_memory=1 << 20, host_memory="64MiB")
    llm.model.experts.maps_host_experts = True
    scheduler = llm.router.engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, decode_run_s=None)
    return llm


@pytest.mark.parametrize("arch", ["mixtral", "glm4_moe"])   # (glm4: sigmoid-grouped routing)
def test_greedy_generation_with_graphs_equals_without(arch, hf_checkpoints, monkeypatch):
    """Batches of five and two sequences (capture sizes 8 and 2), their decode steps run back
    to back (the engine's multi-step decode); each sequence's first token comes from an
    eager prefill."""
    monkeypatch.setattr(triton_ops, "takes", lambda x: True)
    llm = _table_llm(hf_checkpoints[arch][0])   # (glm4: a shared expert, a dense first layer)
    runs = [[[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15], [3, 1, 4, 1, 5]],
            [[7, 7, 2], [9, 8, 7, 6]]]

    def generate() -> list[list[int]]:
        return [out.token_ids for prompts in runs
                for out in llm.generate(prompt_token_ids=prompts, max_tokens=5,
                                        temperature=0.0, ignore_eos=True)]

    want = generate()
    model = llm.model
    model.use_graphs(EagerCapture())
    engine_steps, replays = [], []
    graph_steps, step = model._graph_steps, model.graphs.step
    model._graph_steps = lambda *a: engine_steps.append(1) or graph_steps(*a)
    model.graphs.step = lambda *a: replays.append(1) or step(*a)
    assert generate() == want
    assert model.graphs.sizes == [2, 8]
    # a batch's decode steps replay back to back (multi-step decode: one engine step each run)
    assert len(replays) > len(engine_steps) > 0


class _FailingCapture:
    """A capture that cannot record (say, an op the GPU's graphs refuse)."""

    def capture(self, step):
        raise RuntimeError("operation not permitted when stream is capturing")

    def release(self):
        pass


def test_a_step_that_cannot_be_captured_runs_eagerly_from_then_on(model, caplog):
    batch = decode_batch(model, torch.Generator().manual_seed(5))
    want = model.forward_batch(batch)
    model.use_graphs(_FailingCapture())
    torch.testing.assert_close(model.forward_batch(batch), want, atol=1e-4, rtol=1e-4)
    assert model.graphs is None
    assert "decodes without CUDA graphs" in caplog.text
    assert "not permitted when stream is capturing" in caplog.text
    assert model.experts.slot_pool.holds == 0


def test_a_run_whose_later_step_must_page_ends_there(hf_checkpoints, monkeypatch):
    """A run's second step finds an expert only on disk (forced here): the run ends after its
    first step, whose token stands, and the engine's next step pages; the tokens are the
    eager ones (a run that re-ran its first step would sample it twice)."""
    monkeypatch.setattr(triton_ops, "takes", lambda x: True)
    llm = _table_llm(hf_checkpoints["mixtral"][0])
    prompts = [[1, 2, 3], [4, 5, 6, 7]]

    def generate() -> list[list[int]]:
        return [out.token_ids for out in llm.generate(prompt_token_ids=prompts, max_tokens=6,
                                                      temperature=0.0, ignore_eos=True)]

    want = generate()
    model = llm.model
    model.use_graphs(EagerCapture())
    graph_step, calls = model._graph_step, []

    def every_second_misses(batch):
        calls.append(1)
        return None if len(calls) % 2 == 0 else graph_step(batch)
    model._graph_step = every_second_misses
    assert generate() == want
    assert len(calls) >= 4

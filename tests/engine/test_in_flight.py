"""Steps in flight: a step whose expert reads have not landed parks while other models step,
then resumes with the same tokens it would have produced alone; dropping a parked step (an
abort) loses nothing else."""

from __future__ import annotations

import threading

import pytest
import torch

from mox import LLM
from mox.engine import Engine, SchedulerConfig
from mox.messages import FinishReason, Request
from mox.sampling import SamplingParams
from tests.conftest import open_tiny, serve_loaded
from tests.engine.test_engine import _alone, _tokens

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MAX_STEPS = 200


@pytest.fixture()
def gated(hf_checkpoints):
    """An engine serving "paged" (olmoe, 4 of its 16 expert slots, reads held at a gate) and
    "resident" (mixtral, every expert in memory); yields (engine, gate, paged decoder)."""
    path = hf_checkpoints["olmoe"][0]
    nbytes = open_tiny(path).experts.expert_nbytes
    llm = LLM(path, dtype=torch.float32, kv_memory=1 << 20, expert_memory=4 * nbytes)
    paged = llm.model
    loader = paged.experts.loader
    gate, load = threading.Event(), loader.load

    def held(*args, **kwargs):
        assert gate.wait(30), "the test never opened the gate"
        return load(*args, **kwargs)

    loader.load = held
    engine = Engine(16 << 20, block_size=4, config=SchedulerConfig(max_batched_tokens=16))
    serve_loaded(engine, "paged", paged)
    serve_loaded(engine, "resident", open_tiny(hf_checkpoints["mixtral"][0]))
    try:
        yield engine, gate, paged
    finally:
        gate.set()
        loader.load = load


def _step_until(engine: Engine, outputs: dict[str, list], done) -> None:
    for _ in range(MAX_STEPS):
        if done():
            return
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("not done within the step bound")


def test_a_step_waiting_for_reads_parks_while_another_model_runs(gated, hf_checkpoints):
    engine, gate, paged = gated
    engine.add_request(Request("p", "paged", [3, 1, 4, 1, 5], GREEDY))
    engine.add_request(Request("r", "resident", [2, 7, 1], GREEDY))
    outputs: dict[str, list] = {}
    # every read of "paged" is held: its first step parks, and "resident" runs to its end
    _step_until(engine, outputs, lambda: "r" in outputs and outputs["r"][-1].finish_reason)
    assert "p" not in outputs and engine.scheduler.queues["paged"].in_flight
    assert engine.has_work
    gate.set()
    _step_until(engine, outputs, lambda: not engine.has_work)
    reference = open_tiny(hf_checkpoints["olmoe"][0])
    assert _tokens(outputs["p"]) == _alone(reference, [3, 1, 4, 1, 5], GREEDY.max_tokens)
    resident = open_tiny(hf_checkpoints["mixtral"][0])
    assert _tokens(outputs["r"]) == _alone(resident, [2, 7, 1], GREEDY.max_tokens)
    assert engine.last_step is not None
    assert engine.kv_pool.used_bytes == 0
    assert paged.experts.slot_pool.is_quiet        # no lease outlives its step
    paged.experts.check_integrity()


def test_aborting_a_request_of_a_parked_step_ends_it_and_the_step_goes_on(gated,
                                                                           hf_checkpoints):
    """The aborted request ends at once; its KV blocks (which the parked step still writes)
    are freed when the step ends; the other request of the step continues from it."""
    engine, gate, paged = gated
    engine.add_request(Request("a", "paged", [3, 1, 4], GREEDY))
    engine.add_request(Request("b", "paged", [5, 9, 2, 6], GREEDY))
    engine.add_request(Request("r", "resident", [2, 7, 1], GREEDY))
    outputs: dict[str, list] = {}
    engine.step()                       # "paged" parks on its held reads, "resident" steps
    assert engine.last_step.model == "resident"
    assert engine.scheduler.queues["paged"].in_flight
    aborted = engine.scheduler.queues["paged"].running[0]
    out = engine.abort("a")
    assert out.finish_reason == FinishReason.ABORT and engine.abort("a") is None
    assert engine.scheduler.queues["paged"].in_flight       # b's step goes on
    assert aborted.block_table                              # still written by the step
    gate.set()
    _step_until(engine, outputs, lambda: not engine.scheduler.queues["paged"].in_flight)
    assert not aborted.block_table and "a" not in outputs   # freed; its token dropped
    _step_until(engine, outputs, lambda: not engine.has_work)
    reference = open_tiny(hf_checkpoints["olmoe"][0])
    assert _tokens(outputs["b"]) == _alone(reference, [5, 9, 2, 6], GREEDY.max_tokens)
    assert engine.kv_pool.used_bytes == 0
    paged.experts.wait_for_loads()
    assert paged.experts.slot_pool.is_quiet
    paged.experts.check_integrity()


def test_a_parked_step_whose_requests_all_abort_is_dropped(gated):
    engine, gate, paged = gated
    engine.add_request(Request("a", "paged", [3, 1, 4], GREEDY))
    engine.add_request(Request("r", "resident", [2, 7, 1], GREEDY))
    engine.step()
    assert engine.scheduler.queues["paged"].in_flight
    held = engine.kv_pool.used_bytes
    engine.abort("a")
    assert not engine.scheduler.queues["paged"].in_flight
    assert engine.kv_pool.used_bytes < held                 # its KV went with the step
    gate.set()
    outputs: dict[str, list] = {}
    _step_until(engine, outputs, lambda: not engine.has_work)
    assert engine.kv_pool.used_bytes == 0 and "a" not in outputs
    paged.experts.wait_for_loads()
    assert paged.experts.slot_pool.is_quiet


def test_a_parked_steps_sequences_are_never_preempted(gated):
    """Another model's step that needs KV preempts only sequences not in a parked step (that
    step is writing their blocks)."""
    engine, gate, _ = gated
    engine.add_request(Request("r", "resident", [2, 7, 1], GREEDY))
    engine.add_request(Request("p", "paged", list(range(1, 12)), GREEDY))   # the newest
    engine.step()                       # "paged" parks on its held reads, "resident" steps
    assert engine.scheduler.queues["paged"].in_flight
    parked = engine.scheduler.queues["paged"].running[0]
    newest = engine.scheduler._newest_running(exclude=None)
    assert newest is not None and newest.model == "resident"
    engine.step()
    assert parked.block_table and parked in engine.scheduler.queues["paged"].running


def test_a_sequence_waits_for_kv_a_parked_step_holds_instead_of_ending(gated, hf_checkpoints):
    """The KV pool is full and only a parked step's sequences could give blocks back: a
    decode that needs a block waits for them (preempted, recomputed later) rather than
    ending as if the pool were its context limit."""
    engine, gate, _ = gated
    engine.add_request(Request("p", "paged", list(range(1, 12)), GREEDY))
    engine.add_request(Request("r", "resident", [2, 7, 1, 8], GREEDY))   # one whole block
    outputs: dict[str, list] = {}
    for out in engine.step():           # "paged" parks, "resident" prefills (its one block)
        outputs.setdefault(out.request_id, []).append(out)
    assert engine.scheduler.queues["paged"].in_flight and len(outputs["r"]) == 1
    budget = engine.kv_pool.budget_bytes
    engine.kv_pool.budget_bytes = engine.kv_pool.used_bytes     # r's next token needs a block
    gate.set()
    for out in engine.step():
        outputs.setdefault(out.request_id, []).append(out)
    assert all(out.finish_reason is None for out in outputs["r"])
    engine.kv_pool.budget_bytes = budget
    _step_until(engine, outputs, lambda: not engine.has_work)
    resident = open_tiny(hf_checkpoints["mixtral"][0])
    assert _tokens(outputs["r"]) == _alone(resident, [2, 7, 1, 8], GREEDY.max_tokens)
    assert engine.kv_pool.used_bytes == 0

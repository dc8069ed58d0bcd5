"""The scheduler on its own (no model runs): which model steps next, and the round a TPOT
target keeps. Steps are simulated: every scheduled token is computed, a sampled one appended,
and each step of a model takes the loop the seconds the test gives it."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mox.engine.kv_pool import KVPool
from mox.engine.scheduler import Batch, Scheduler, SchedulerConfig
from mox.engine.sequence import Sequence
from mox.messages import Request
from mox.models.kv_store import KVStore
from mox.sampling import SamplingParams

MAX_STEPS = 2000


def _scheduler(models: list[str], target_s: float | None) -> Scheduler:
    pool = KVPool(1 << 20, block_size=4)
    scheduler = Scheduler(SchedulerConfig(tpot_target_s=target_s), pool)
    for name in models:
        pool.add_model(name, KVStore(1, 1, 4, torch.float32, torch.device("cpu"), 4))
        scheduler.add_model(name)
        scheduler.set_ready(name, True)
    return scheduler


def _add(scheduler: Scheduler, model: str, arrival: float, max_tokens: int = 4) -> Sequence:
    request = Request(f"{model}-{arrival}", model, [1, 2, 3], SamplingParams(max_tokens))
    seq = Sequence(request, torch.Generator(), arrival_time=arrival)
    scheduler.add(seq)
    return seq


def _step(scheduler: Scheduler, step_s: dict[str, float]) -> str | None:
    """One simulated step: its model, or None when nothing was scheduled."""
    batch = scheduler.schedule()
    if batch is None:
        return None
    _step_batch(scheduler, batch)
    scheduler.record_step(batch.model, step_s[batch.model])
    return batch.model


def _step_batch(scheduler: Scheduler, batch: Batch) -> None:
    """The batch computed: its tokens sampled (7), its finished sequences released."""
    for s in batch.sequences:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        if samples:
            s.seq.output_token_ids.append(7)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                scheduler.release(s.seq)


def _run(scheduler: Scheduler, step_s: dict[str, float]) -> list[str]:
    """Models in step order until no work is left."""
    order = []
    for _ in range(MAX_STEPS):
        if not scheduler.has_work:
            return order
        model = _step(scheduler, step_s)
        assert model is not None, "runnable work but nothing scheduled"
        order.append(model)
    raise AssertionError("work left after the step bound")


def test_without_a_target_every_model_with_work_takes_turns():
    scheduler = _scheduler(["a", "b", "c"], None)
    for i, model in enumerate("abc"):
        _add(scheduler, model, arrival=i)
    order = _run(scheduler, {"a": 0.1, "b": 0.1, "c": 0.1})
    assert order[:3] == ["a", "b", "c"] and order[3:6] == ["a", "b", "c"]


def test_a_model_joins_only_while_the_round_stays_within_the_target():
    step_s = {"a": 0.1, "b": 0.1, "c": 0.1}
    scheduler = _scheduler(["a", "b", "c"], 0.25)
    for model in "abc":                # each model's step time is known from earlier work
        scheduler.record_step(model, step_s[model])
    for i, model in enumerate("abc"):
        _add(scheduler, model, arrival=i)
    order = _run(scheduler, step_s)
    first_c = order.index("c")
    # a and b make a 0.2 s round: c (another 0.1 s) joins once a has finished (its 4 steps),
    # beside b's last
    assert order[:first_c].count("a") == 4 and order[:first_c].count("b") == 3
    assert order[first_c:].count("b") == 1


def test_a_held_model_is_not_starved_by_newer_requests_of_running_ones():
    step_s = {"a": 0.2, "b": 0.2}
    scheduler = _scheduler(["a", "b"], 0.3)
    for model in "ab":
        scheduler.record_step(model, step_s[model])
    _add(scheduler, "a", arrival=0)
    _add(scheduler, "b", arrival=1)
    assert _step(scheduler, step_s) == "a"           # a runs; b would make the round 0.4 s
    older = _add(scheduler, "a", arrival=0.5)        # before b's request: a may start it
    newer = _add(scheduler, "a", arrival=2)          # after it: not until b has run
    order, started = [], {}
    for _ in range(MAX_STEPS):
        if not scheduler.has_work:
            break
        model = _step(scheduler, step_s)
        order.append(model)
        for seq in (older, newer):
            if seq.num_computed_tokens and seq.request_id not in started:
                started[seq.request_id] = len(order)
    assert "b" in order
    assert started[older.request_id] < order.index("b") < started[newer.request_id]


def test_an_empty_round_admits_a_model_over_the_target_and_an_unmeasured_one_joins():
    scheduler = _scheduler(["a", "b", "c"], 0.05)
    scheduler.record_step("a", 1.0)                  # alone, a's step is over the target
    _add(scheduler, "a", arrival=0)
    _add(scheduler, "b", arrival=1)
    order = _run(scheduler, {"a": 1.0, "b": 0.01, "c": 0.01})
    assert order == ["a"] * 4 + ["b"] * 4            # b only once a's round is over
    _add(scheduler, "b", arrival=2)
    _add(scheduler, "c", arrival=3)                  # no step time yet: it fits any round
    assert set(_run(scheduler, {"a": 1.0, "b": 0.01, "c": 0.01})[:2]) == {"b", "c"}


@settings(max_examples=40, deadline=None)
@given(step_ms=st.lists(st.integers(1, 300), min_size=2, max_size=5),
       target_ms=st.integers(1, 600),
       arrivals=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6)), min_size=1,
                         max_size=12))
def test_every_request_finishes_and_a_full_round_never_grows(step_ms, target_ms, arrivals):
    models = [f"m{i}" for i in range(len(step_ms))]
    step_s = {m: ms / 1000 for m, ms in zip(models, step_ms)}
    scheduler = _scheduler(models, target_ms / 1000)
    for m in models:
        scheduler.record_step(m, step_s[m])
    seqs = [_add(scheduler, models[i % len(models)], arrival=t, max_tokens=n)
            for t, (i, n) in enumerate(arrivals)]
    for _ in range(MAX_STEPS):
        if not scheduler.has_work:
            break
        running = {m for m, q in scheduler.queues.items() if q.running}
        model = _step(scheduler, step_s)
        assert model is not None
        if model not in running and running:
            # a model joined a round that was not empty: the round stays within the target
            assert sum(step_s[m] for m in running | {model}) <= target_ms / 1000 + 1e-9
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)


def _decoding(scheduler: Scheduler, model: str, arrival: float, max_tokens: int) -> Sequence:
    """A request of `model` past its prefill: its next step decodes one token."""
    seq = _add(scheduler, model, arrival, max_tokens)
    _step(scheduler, {model: 0.01})
    assert seq.num_uncomputed_tokens == 1
    return seq


def test_a_decode_batch_alone_runs_several_steps_with_their_kv_reserved():
    scheduler = _scheduler(["a"], None)
    scheduler.config = SchedulerConfig(decode_steps=4)
    seqs = [_decoding(scheduler, "a", t, max_tokens=20) for t in (1.0, 2.0)]
    batch = scheduler.schedule()
    assert batch.num_steps == 4
    for seq in seqs:                 # KV for all four tokens, before the batch starts
        assert len(seq.block_table) * 4 >= seq.num_computed_tokens + 4


def test_a_run_of_decode_steps_lasts_about_decode_run_s_at_the_models_step_time():
    scheduler = _scheduler(["a"], None)
    scheduler.config = SchedulerConfig(decode_steps=16, decode_run_s=0.1)
    seq = _add(scheduler, "a", 1.0, max_tokens=100)
    assert scheduler.schedule().num_steps == 1          # the prompt
    seq.num_computed_tokens, seq.output_token_ids = seq.num_tokens, [7]
    assert scheduler.schedule().num_steps == 16         # no step timed yet: decode_steps
    for step_s, steps in ((0.03, 3), (0.07, 1), (0.001, 16), (0.5, 1)):
        scheduler.queues["a"].decode_step_s = 0.0       # (the next record is the whole EWMA)
        scheduler.record_step("a", step_s, decodes_only=True)
        assert scheduler.schedule().num_steps == steps
    scheduler.queues["a"].decode_step_s = 0.0
    scheduler.record_step("a", 0.01, decodes_only=True)
    scheduler.record_step("a", 5.0)                     # a prompt's step: not a decode's time
    assert scheduler.schedule().num_steps == 10         # 0.1 s / 0.01 s


def test_steps_back_to_back_stop_at_max_tokens_and_wait_for_nothing_else():
    scheduler = _scheduler(["a", "b"], None)
    scheduler.config = SchedulerConfig(decode_steps=8)
    seq = _decoding(scheduler, "a", 1.0, max_tokens=4)
    # three tokens left: never more steps than the sequence may still generate
    assert scheduler.schedule().num_steps == seq.params.max_tokens - seq.num_output_tokens == 3
    scheduler.set_ready("b", False)
    cold = _add(scheduler, "b", 2.0)     # waits for its weights, which land between steps
    assert scheduler.schedule().num_steps == 1
    scheduler.release(cold)
    prompt = _add(scheduler, "a", 3.0)   # a prompt joins the batch: one step
    batch = scheduler.schedule()
    assert [s.seq for s in batch.sequences] == [seq, prompt] and batch.num_steps == 1


def test_two_sequences_that_cannot_both_fit_run_one_after_the_other():
    """A preempted sequence was let back in as soon as its next chunk fit, recomputed its
    context, and was preempted again when the pool refilled: two long streams crawled,
    recomputing, for tens of seconds. Now it waits for an end (here: the other's)."""
    store = KVStore(1, 1, 4, torch.float32, torch.device("cpu"), 4)
    pool = KVPool(16 * store.block_nbytes, block_size=4)          # 64 tokens
    scheduler = Scheduler(SchedulerConfig(max_batched_tokens=4), pool)
    pool.add_model("a", store)
    scheduler.add_model("a")
    scheduler.set_ready("a", True)
    first, second = (_add(scheduler, "a", t, max_tokens=40) for t in (1.0, 2.0))  # 43 each
    computed = 0
    for _ in range(MAX_STEPS):
        if not scheduler.has_work:
            break
        batch = scheduler.schedule()
        computed += batch.num_tokens
        _step_batch(scheduler, batch)
    assert first.num_output_tokens == second.num_output_tokens == 40
    assert first.num_preemptions == 0 and second.num_preemptions == 1
    # each sequence's tokens once, and the victim's context once more
    assert computed <= 2 * 43 + 32
    pool.check_integrity()


"""The router on tiny real checkpoints, with an injected clock: plans follow traffic within
the budget, cold starts, admission, timeouts, idle parking and every policy."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from mox import LLM
from mox.errors import (
    AdmissionError,
    CheckpointError,
    ModelUnavailableError,
    MoxError,
    RequestTimeoutError,
)
from mox.messages import FinishReason, ModelSettings, ModelState, Request
from mox.router import ROUTER_POLICIES, Router, RouterConfig
from mox.router.memory_policy import TURN_S
from mox.router.timeline import DecodeCosts, StepRecord
from mox.sampling import SamplingParams

STEP_S = 0.05                     # simulated seconds per engine step
MAX_STEPS = 2000


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _router(hf_checkpoints, names=("a", "b"), clock=None, experts=6, settings=None,
            **config) -> Router:
    """Models named `names`, each the tiny olmoe checkpoint (8 experts x 2 layers), with a
    device budget of every dense weight plus `experts` experts."""
    path = hf_checkpoints["olmoe"][0]
    probe = Router({"probe": path}, RouterConfig(dtype="float32"))
    dense, expert = probe.models["probe"].dense_nbytes, probe.models["probe"].pool.expert_nbytes
    # a fixed thread count: by default the engine steps with one thread fewer while reads are
    # in flight, which moves the float sums, hence the greedy tokens, the experts they route to
    # and the miss-ratio curves these tests' plans follow, with the I/O timing
    config = {"dtype": "float32", "kv_memory": 16 << 20, "plan_period_s": 1.0,
              "compute_threads": 2,
              "device_memory": len(names) * dense + experts * expert, **config}
    return Router({n: path for n in names}, RouterConfig(**config), clock=clock or FakeClock(),
                  settings=settings)


def _step(router: Router, clock: FakeClock | None = None, settle: bool = False) -> list:
    """One router step; waits for a landing load when there is nothing to run (`settle`: for
    any load in flight, so a load takes no simulated time and the order of turns is the
    traffic's, not the disk's)."""
    loading = any(m.state == ModelState.LOADING for m in router.models.values())
    if settle and loading:
        router._loader.drain()
    elif not router.has_work and loading:
        assert router.wake.wait(30), "a load never landed"
        router.wake.clear()
    outputs = router.step()
    budget = router.config.device_memory
    if budget is not None and router.config.policy != "all-resident":
        assert router.residency.used_bytes() <= budget
    if clock is not None:
        clock.now += STEP_S
    return outputs


def _run(router: Router, clock: FakeClock | None, until, settle: bool = False
         ) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(MAX_STEPS):
        for out in _step(router, clock, settle):
            outputs.setdefault(out.request_id, []).append(out)
        if until(outputs):
            return outputs
    raise AssertionError("did not finish")


def _finished(ids):
    return lambda outs: all(any(o.finish_reason for o in outs.get(i, [])) for i in ids)


def test_slots_follow_a_shift_of_traffic(hf_checkpoints):
    clock = FakeClock()
    router = _router(hf_checkpoints, clock=clock, experts=12)
    counter = iter(range(10**6))

    def traffic(model: str, periods: int) -> None:
        for _ in range(periods):
            ids = [f"{model}{next(counter)}" for _ in range(2)]
            for i, rid in enumerate(ids):
                router.add_request(Request(rid, model, [3 + i, 4, 5], _params(4)))
            _run(router, clock, _finished(ids))
            clock.now += 1.0

    traffic("a", 6)
    slots_a = router.models["a"].pool.num_slots
    assert slots_a > 6                                   # a holds most of the 12
    traffic("b", 12)
    pools = {n: router.models[n].pool.num_slots for n in "ab"}
    assert pools["b"] > pools["a"] and pools["a"] < slots_a     # (within budget: `_step`)


class UnmeasuredCosts(DecodeCosts):
    """Decode costs that ignore the steps' wall-clock seconds: the planner then prices a run
    size at its defaults. Measured, a miss cost 0.2 ms in one run and 4 ms in the next (the
    I/O threads' timing), which moved the run sizes, hence the plans, from run to run."""

    def add(self, r: StepRecord) -> None:
        pass


def test_steady_traffic_does_not_thrash(hf_checkpoints):
    clock = FakeClock()
    router = _router(hf_checkpoints, clock=clock, experts=10)
    router.timeline.costs = UnmeasuredCosts()
    history = []
    for period in range(12):
        ids = [f"{m}{period}" for m in "ab"]
        for rid in ids:
            router.add_request(Request(rid, rid[0], [3, 4, 5 + period % 3], _params(3)))
        # settled loads: a load that landed a few steps later let the other model's turn
        # end first, and one period's snapshot caught a's pool instead of b's (CI)
        _run(router, clock, _finished(ids), settle=True)
        clock.now += 1.0
        history.append(tuple(router.models[n].pool.num_slots for n in "ab"))
    steady = history[4:]
    changes = sum(x != y for x, y in zip(steady, steady[1:]))
    assert changes <= 1, f"{history}"   # a string: pytest shows it whole


def test_a_cold_model_waits_for_room_then_gets_a_turn(hf_checkpoints):
    clock = FakeClock()
    # b is pinned (every expert, 16) so the room does not hang on b's learned run size, which
    # the greedy tokens decide: room for a and b, but not for c's every expert (its curve is
    # unknown) beside them; room for c once a is parked
    router = _router(hf_checkpoints, names=("a", "b", "c"), clock=clock, experts=32,
                     settings={"b": ModelSettings(pin=True)})
    # nothing holds memory
    assert router.snapshot()["models"]["c"]["cold_start"] == {"waits": False, "parks": [],
                                                              "squeezes": {}}
    # long enough to still run at the turn however many steps it took while b loaded (b's
    # load runs on its own thread in real time, a decodes meanwhile: 60 tokens were sometimes
    # done before the turn, and a with no work is no victim)
    router.add_request(Request("a-1", "a", [3, 4, 5], _params(200)))
    router.add_request(Request("b-long", "b", [3, 4, 5], _params(240)))    # near the context
    _run(router, clock, lambda outs: len(outs.get("a-1", [])) >= 3
         and len(outs.get("b-long", [])) >= 3)
    # what the replica reports to a fleet's request router: c would wait for a's turn
    router.replan()
    assert router.snapshot()["models"]["c"]["cold_start"] == {"waits": True, "parks": [],
                                                              "squeezes": {}}
    assert "cold_start" not in router.snapshot()["models"]["a"]
    router.add_request(Request("c-1", "c", [7, 8], _params(4)))
    # c's curve is unknown, so it runs only with every expert: it waits rather than squeeze
    # the busy models below their run sizes
    _run(router, clock, lambda outs: len(outs.get("a-1", [])) >= 2)
    assert router.models["c"].state == ModelState.COLD
    clock.now += TURN_S                   # c has waited a turn: a, unpinned, drains
    _run(router, clock, lambda outs: router.models["a"].draining)
    assert router.models["a"].draining and not router.models["b"].draining
    router.add_request(Request("a-2", "a", [3, 9], _params(2)))    # a starts no new request
    order = []

    def until(outs):
        order.extend(rid for rid, got in outs.items() if got and rid not in order)
        return all(any(o.finish_reason for o in outs.get(r, [])) for r in ("c-1", "a-2"))

    outs = _run(router, clock, until)
    assert order.index("c-1") < order.index("a-2")     # c's turn came before a's new request
    assert [o.finish_reason for o in outs["a-1"] if o.finish_reason] == [FinishReason.LENGTH]
    assert outs["b-long"]                                             # b kept decoding
    assert router.models["a"].num_loads == 2 and router.models["c"].num_loads == 1
    # the timeline's events tell the turn: a drained, parked, then c loaded, then a again
    events = [(e.event, e.model, e.why) for e in router.timeline.events if e.model != "b"]
    assert events[events.index(("drain", "a", "")):] == [
        ("drain", "a", ""), ("park", "a", "drained"), ("load", "c", ""), ("landed", "c", ""),
        ("load", "a", ""), ("landed", "a", "")], events
    for name in router.models:
        router.models[name].pool.check_integrity()


def test_a_warm_idle_model_without_room_waits_like_a_cold_one(hf_checkpoints):
    clock = FakeClock()
    # a busy a at any run size (>= its working set, 4) leaves b's idle minimum (top_k = 2)
    # but not b's run size (all 16 experts: one token is too little history for its curve)
    router = _router(hf_checkpoints, names=("a", "b"), clock=clock, experts=18)
    router.add_request(Request("b-1", "b", [3], _params(1)))
    _run(router, clock, _finished(["b-1"]))                           # b warm, then idle
    router.add_request(Request("a-long", "a", [3, 4, 5], _params(60)))
    _run(router, clock, lambda outs: len(outs.get("a-long", [])) >= 3)
    assert router.models["b"].state == ModelState.WARM
    router.add_request(Request("b-2", "b", [3, 4], _params(2)))
    assert router.models["b"].state == ModelState.COLD                # parked: no room
    outs = _run(router, clock, _finished(["b-2"]))
    # b ran again only once a finished (an idle a was then parked to make room)
    assert any(o.finish_reason for o in outs["a-long"]) and router.models["b"].num_loads == 2


def test_a_readmitted_model_reads_ahead_what_its_idle_time_shrank(hf_checkpoints):
    clock = FakeClock()
    router = _router(hf_checkpoints, names=("a",), clock=clock, experts=16)
    pool = router.models["a"].pool
    router.add_request(Request("a-1", "a", [3, 4, 5], _params(2)))
    _run(router, clock, _finished(["a-1"]))                   # a warm, then idle
    pool.resize(pool.top_k)          # the planner squeezes an idle pool when others need room
    assert pool.slot_pool.num_occupied == pool.top_k
    preloads = pool.stats()["preloads"]
    router.add_request(Request("a-2", "a", [3, 9, 4], _params(4)))
    # its run size (every expert: a few tokens are too short a history for its curve) is read
    # ahead at once, not met as misses one wave at a time in its steps
    assert pool.num_slots == pool.max_slots
    assert pool.stats()["preloads"] - preloads == pool.max_slots - pool.top_k
    pool.wait_for_loads()
    steps = len(router.timeline.records)
    _run(router, clock, _finished(["a-2"]))
    assert [r.misses for r in list(router.timeline.records)[steps:]] == [0] * 4


def test_admission_limits_and_queue_timeouts(hf_checkpoints):
    clock = FakeClock()
    router = _router(hf_checkpoints, clock=clock, max_waiting_per_model=2, max_waiting=3,
                     queue_timeout_s=5.0)
    router.add_request(Request("a1", "a", [3], _params(2)))
    router.add_request(Request("a2", "a", [3], _params(2)))
    with pytest.raises(AdmissionError) as refused:
        router.add_request(Request("a3", "a", [3], _params(2)))
    assert refused.value.retry_after_s >= 1
    router.add_request(Request("b1", "b", [3], _params(2)))
    with pytest.raises(AdmissionError, match="server"):
        router.add_request(Request("b2", "b", [3], _params(2)))
    clock.now += 6.0                                     # nothing ran: all waited too long
    outputs = router.step()
    assert {o.request_id for o in outputs} == {"a1", "a2", "b1"}
    assert all(o.finish_reason == FinishReason.ABORT for o in outputs)
    error = router.take_error("a1")
    assert isinstance(error, RequestTimeoutError) and "5 s" in str(error)
    assert router.engine.kv_pool.used_bytes == 0 and router.engine.num_live == 0


def test_idle_models_are_parked(hf_checkpoints):
    clock = FakeClock()
    router = _router(hf_checkpoints, clock=clock, dense_idle_s=30.0)
    router.add_request(Request("a1", "a", [3, 4], _params(3)))
    _run(router, clock, _finished(["a1"]))
    used = router.residency.used_bytes()
    assert router.models["a"].state == ModelState.WARM and used > 0
    clock.now += 31.0
    router.step()
    assert router.models["a"].state == ModelState.COLD
    assert router.residency.used_bytes() == 0
    router.add_request(Request("a2", "a", [3, 4], _params(3)))       # and comes back
    _run(router, clock, _finished(["a2"]))
    assert router.models["a"].num_loads == 2


def test_a_released_model_parks_once_its_running_requests_finish(hf_checkpoints):
    """A fleet's replica that no longer holds a model (mox.fleet) releases it: parked now if
    idle, after its running requests otherwise; a pinned model stays."""
    clock = FakeClock()
    router = _router(hf_checkpoints, names=("a", "b", "pinned"), clock=clock, experts=30,
                     settings={"pinned": ModelSettings(pin=True)})
    router.warm_up("pinned")
    router.add_request(Request("a1", "a", [3, 4], _params(3)))
    _run(router, clock, _finished(["a1"]))
    router.release("a")                                        # idle: parked at once
    assert router.models["a"].state == ModelState.COLD
    router.add_request(Request("b1", "b", [3, 4], _params(30)))
    _run(router, clock, lambda outs: "b1" in outs)             # b is running
    router.release("b")
    assert router.models["b"].state == ModelState.WARM         # finishing its request
    outputs = _run(router, clock, _finished(["b1"]))
    assert outputs["b1"][-1].finish_reason == FinishReason.LENGTH
    _step(router, clock)
    assert router.models["b"].state == ModelState.COLD
    router.release("pinned")
    assert router.models["pinned"].state == ModelState.WARM
    router.add_request(Request("a2", "a", [3, 4], _params(2)))    # a released model comes back
    _run(router, clock, _finished(["a2"]))
    assert router.models["a"].num_loads == 2


def test_pinned_models_load_whole_and_stay_and_keep_alive_is_per_model(hf_checkpoints):
    clock = FakeClock()
    path = hf_checkpoints["olmoe"][0]
    probe = Router({"p": path}, RouterConfig(dtype="float32"))
    dense, expert = probe.models["p"].dense_nbytes, probe.models["p"].pool.expert_nbytes
    settings = {"pinned": ModelSettings(pin=True), "brief": ModelSettings(keep_alive_s=5.0)}
    router = Router({n: path for n in ("pinned", "brief", "other")},
                    RouterConfig(dtype="float32", kv_memory=16 << 20, dense_idle_s=30.0,
                                 device_memory=3 * dense + 34 * expert),
                    clock=clock, settings=settings)
    router.warm_up("pinned")                                  # loading since registration
    pinned = router.models["pinned"]
    assert pinned.num_loads == 1 and pinned.pool.num_slots == 16
    assert pinned.pool.stats()["resident_bytes"] == 16 * expert          # every expert
    for i, model in enumerate(("brief", "other")):
        router.add_request(Request(f"r{i}", model, list(range(3, 40)), _params(2)))
    _run(router, clock, _finished(["r0", "r1"]))
    assert router.models["pinned"].pool.num_slots == 16      # busy neighbours took no slot
    clock.now += 6.0
    router.step()
    assert router.models["brief"].state == ModelState.COLD    # its own keep-alive: 5 s
    assert router.models["other"].state == ModelState.WARM    # the server's: 30 s
    clock.now += 3600.0
    router.step()
    assert router.models["other"].state == ModelState.COLD
    assert pinned.state == ModelState.WARM and pinned.pool.num_slots == 16
    router.configure("other", ModelSettings(pin=True))        # pinning a cold model loads it
    router.warm_up("other")
    assert router.models["other"].pool.num_slots == 16 and router.models["other"].num_loads == 2
    with pytest.raises(MoxError, match="pinned"):             # a third would not fit
        router.configure("brief", ModelSettings(pin=True))
    assert not router.models["brief"].settings.pin


def test_a_pin_makes_room_by_parking_idle_models_or_is_refused(hf_checkpoints):
    clock = FakeClock()
    router = _router(hf_checkpoints, names=("a", "b"), clock=clock, experts=18)
    router.add_request(Request("r", "a", list(range(3, 30)), _params(2)))
    router.add_request(Request("s", "b", list(range(3, 30)), _params(2)))
    _run(router, clock, _finished(["r", "s"]))
    path = hf_checkpoints["olmoe"][0]
    # the budget: both dense + 18 experts; a pinned third needs its dense + all 16 experts
    budget = router.config.device_memory
    dense = router.models["a"].dense_nbytes
    router.config = RouterConfig(**{**router.config.__dict__, "device_memory": budget + dense})
    router.add_model("c", path, ModelSettings(pin=True))
    router.warm_up("c")
    assert router.models["c"].pool.num_slots == 16 and router.residency.used_bytes() <= (
        budget + dense)
    assert ModelState.COLD in (router.models["a"].state, router.models["b"].state)  # parked
    router.add_request(Request("t", "a", list(range(3, 30)), _params(40)))
    router.add_request(Request("u", "b", list(range(3, 30)), _params(40)))
    _step(router, clock)
    with pytest.raises(MoxError, match="pinned"):     # no room for a second whole model
        router.configure("a", ModelSettings(pin=True))
    assert not router.models["a"].settings.pin


def test_model_swap_loads_and_evicts_whole_models(hf_checkpoints):
    clock = FakeClock()
    probe = _router(hf_checkpoints, names=("p",))
    whole = probe.models["p"].dense_nbytes + 16 * probe.models["p"].pool.expert_nbytes
    router = _router(hf_checkpoints, clock=clock, policy="model-swap", experts=0,
                     device_memory=whole + 1000)            # one whole model at a time
    for i, model in enumerate("abab"):
        router.add_request(Request(f"r{i}", model, [3, 4], _params(2)))
        _run(router, clock, _finished([f"r{i}"]))
        assert router.models[model].pool.stats()["num_slots"] == 16
    assert router.models["a"].num_loads == 2 and router.models["b"].num_loads == 2
    stats = router.models["a"].pool.stats()
    assert stats["bytes_read"] == 2 * 16 * stats["expert_bytes"]   # every expert, each load


def test_all_resident_loads_everything_and_never_evicts(hf_checkpoints):
    clock = FakeClock()
    router = _router(hf_checkpoints, clock=clock, policy="all-resident")
    for model in "ab":
        router.warm_up(model)
    loaded = {m: router.models[m].pool.stats()["preloads"] for m in "ab"}
    assert loaded == {"a": 16, "b": 16}                    # every expert read at start-up
    for i in range(6):
        router.add_request(Request(f"r{i}", "ab"[i % 2], [3 + i, 4], _params(3)))
    _run(router, clock, _finished([f"r{i}" for i in range(6)]))
    for model in "ab":
        stats = router.models[model].pool.stats()
        assert stats["evictions"] == 0 and stats["misses"] == 0
        assert stats["num_slots"] == 16
        assert router.models[model].num_loads == 1


def test_removing_a_loading_model_waits_for_nothing_and_frees_it_when_it_lands(
        hf_checkpoints, monkeypatch):
    """Removing a loading model blocked the engine thread until the load landed (every other
    model's streams paused meanwhile); now its requests end at once, what it holds counts
    until its load lands and then goes, and a load that failed meanwhile still ends its own
    requests."""
    from mox.router import served_model
    real, gate = served_model.load_weights, threading.Event()

    def load_weights(model, *args):
        if model.name == "b":
            raise CheckpointError(model.path, "a read failed")
        gate.wait(30)                       # a is still loading when it is removed
        return real(model, *args)
    monkeypatch.setattr(served_model, "load_weights", load_weights)
    router = _router(hf_checkpoints, device_memory=None)        # room to load both at once
    router.add_request(Request("ra", "a", [3, 4], _params(2)))
    router.add_request(Request("rb", "b", [3, 4], _params(2)))
    router.step()
    assert [m.state for m in router.models.values()] == [ModelState.LOADING] * 2
    ended = router.remove_model("a")                # (a's load is held: it must not wait)
    assert [(o.request_id, o.finish_reason) for o in ended] == [("ra", FinishReason.ABORT)]
    assert "a" not in router.models and router.residency.closing_bytes() > 0
    gate.set()
    outputs = _run(router, None, _finished(["rb"]))
    assert "a read failed" in outputs["rb"][-1].error
    assert router.residency.closing_bytes() == 0 and router.models["b"].state == ModelState.FAILED


def test_a_broken_checkpoint_fails_only_its_model(hf_checkpoints, tmp_path):
    good = hf_checkpoints["olmoe"][0]
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(good):
        data = open(os.path.join(good, name), "rb").read()
        if name.endswith(".safetensors"):
            data = data[: len(data) // 2]                       # truncated
        (broken / name).write_bytes(data)
    router = Router({"good": good, "bad": str(broken)}, RouterConfig(dtype="float32"))
    bad = router.models["bad"]
    assert bad.state == ModelState.FAILED and ".safetensors" in bad.error
    with pytest.raises(ModelUnavailableError, match="safetensors"):
        router.add_request(Request("x", "bad", [3], _params(2)))
    router.add_request(Request("y", "good", [3], _params(2)))
    _run(router, None, _finished(["y"]))
    assert router.snapshot()["models"]["bad"]["state"] == "failed"


@pytest.mark.parametrize("name, text", [
    ("generation_config.json", "[1, 2]"), ("generation_config.json", "{broken"),
    ("config.json", "[]"),
])
def test_a_checkpoint_json_file_that_is_not_an_object_fails_its_model(hf_checkpoints, tmp_path,
                                                                       name, text):
    good = hf_checkpoints["olmoe"][0]
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    (broken / name).write_text(text)
    router = Router({"good": good, "bad": str(broken)}, RouterConfig(dtype="float32"))
    assert router.models["bad"].state == ModelState.FAILED
    assert str(broken / name) in router.models["bad"].error
    router.add_request(Request("y", "good", [3], _params(2)))
    _run(router, None, _finished(["y"]))


def test_a_checkpoints_generation_config_sets_its_sampling_defaults(hf_checkpoints,
                                                                    tmp_path, caplog):
    model = tmp_path / "m"
    shutil.copytree(hf_checkpoints["olmoe"][0], model)
    (model / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [5, 7],'
        ' "repetition_penalty": 1.05, "min_p": 0.0}')
    router = Router({"m": str(model)}, RouterConfig(dtype="float32"))
    served = router.served("m")
    assert served.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert {5, 7} <= set(served.eos_token_ids)
    # what mox has no sampler for is said, not dropped silently (min_p 0 is off)
    said = [r.getMessage() for r in caplog.records if "does not apply" in r.getMessage()]
    assert len(said) == 1 and "repetition_penalty': 1.05" in said[0] and "min_p" not in said[0]


def test_a_model_that_would_leave_another_no_room_is_refused_and_the_others_serve(
        hf_checkpoints):
    """Models are checked against the budget as they are added: one that shrinks the equal
    split below another's top_k fails (holding no share), and a pin that leaves another
    model less than its minimum is dropped; the models before them serve (a parked plan of
    zero slots used to reach the engine and fail every request with an internal error)."""
    probe = _router(hf_checkpoints, names=("p",))
    dense = probe.models["p"].dense_nbytes
    experts = probe.models["p"].pool.expert_nbytes * probe.models["p"].pool.top_k
    path = hf_checkpoints["olmoe"][0]
    # lru: two models' equal shares hold top_k experts each, three models' would not
    router = _router(hf_checkpoints, names=("a", "b"), policy="lru",
                     device_memory=2 * dense + 2 * experts)
    router.add_model("c", path)
    assert router.models["c"].state == ModelState.FAILED
    assert "equal split" in router.models["c"].error and router.models["c"].pool is None
    with pytest.raises(ModelUnavailableError, match="equal split"):
        router.add_request(Request("x", "c", [3], _params(2)))
    # rate: a whole pinned model beside another's minimum is more than the budget
    whole = dense + 16 * probe.models["p"].pool.expert_nbytes
    pinned = _router(hf_checkpoints, names=("a",), device_memory=whole + dense)
    pinned.add_model("c", path, ModelSettings(pin=True))
    assert not pinned.models["c"].settings.pin and pinned.models["c"].state != ModelState.FAILED
    for served in (router, pinned):
        for i, name in enumerate(n for n in ("a", "b", "c") if n in served.models
                                 and served.models[n].state != ModelState.FAILED):
            served.add_request(Request(f"r{i}", name, [3, 4, 5], _params(3)))
        outputs = _run(served, None, _finished([f"r{i}" for i in range(2)]))
        assert all(out.error is None for outs in outputs.values() for out in outs)


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
def test_llm_accepts_every_policy(hf_checkpoints, policy):
    path = hf_checkpoints["olmoe"][0]
    reference = LLM(path, dtype="float32").generate(prompt_token_ids=[[3, 4, 5]], max_tokens=6,
                                                    temperature=0.0, ignore_eos=True)
    # about 4 of the 16 experts; whole-model policies need the whole model
    budget = None if policy in ("all-resident", "model-swap") else 100_000
    llm = LLM(path, dtype="float32", policy=policy, expert_memory=budget)
    out = llm.generate(prompt_token_ids=[[3, 4, 5]], max_tokens=6, temperature=0.0,
                       ignore_eos=True)
    assert out[0].token_ids == reference[0].token_ids
    plan = llm.plan()
    assert plan["policy"] == policy and plan["models"][llm.name]["state"] == "warm"


def test_host_cache_is_shared_by_request_rate(hf_checkpoints):
    clock = FakeClock()
    router = _router(hf_checkpoints, clock=clock, experts=4, host_memory=1 << 20)
    for i in range(8):
        router.add_request(Request(f"a{i}", "a", [3 + i, 4], _params(2)))
    router.add_request(Request("b0", "b", [3, 4], _params(2)))
    _run(router, clock, _finished([f"a{i}" for i in range(8)] + ["b0"]))
    router.replan()
    host = router.pager.loader.host_cache
    assert host.quota("a") > 4 * host.quota("b") > 0
    assert host.used_by("a") <= host.quota("a") and host.used_by("b") <= host.quota("b")
    assert router.snapshot()["models"]["a"]["host_cache_bytes"] == host.used_by("a")


def test_models_can_be_removed_and_added_while_serving(hf_checkpoints):
    from mox.errors import ModelNotFoundError

    clock = FakeClock()
    router = _router(hf_checkpoints, clock=clock)
    router.add_request(Request("a1", "a", [3, 4], _params(2)))
    _run(router, clock, _finished(["a1"]))
    router.add_request(Request("a2", "a", [3, 4], _params(50)))
    outputs = router.remove_model("a")
    assert [o.finish_reason for o in outputs] == [FinishReason.ABORT]
    assert isinstance(router.take_error("a2"), ModelNotFoundError)
    assert "a" not in router.models and router.residency.used_bytes() == 0
    with pytest.raises(ModelNotFoundError):
        router.add_request(Request("a3", "a", [3], _params(2)))
    router.add_model("c", hf_checkpoints["mixtral"][0])
    router.add_request(Request("c1", "c", [3, 4], _params(2)))
    router.add_request(Request("b1", "b", [3, 4], _params(2)))
    _run(router, clock, _finished(["c1", "b1"]))


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
def test_an_idle_router_has_nothing_due_now(hf_checkpoints, policy):
    """A driver sleeps `seconds_until_due()`: it must not be 0 while idle (a busy loop)."""
    clock = FakeClock()
    router = _router(hf_checkpoints, clock=clock, policy=policy,
                     device_memory=None if policy in ("all-resident", "model-swap") else 10**9)
    router.add_request(Request("a1", "a", [3, 4], _params(2)))
    _run(router, clock, _finished(["a1"]))
    for _ in range(3):                                 # past the idle time, too
        clock.now += 200.0
        router.step()
        due = router.seconds_until_due()
        assert due is None or due > 0, (policy, due)


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_grown_pool_prefetches_popular_experts_only_where_prefetch_is_on(hf_checkpoints,
                                                                            prefetch):
    # on a CPU (prefetch off by default) guessed reads would take the cores and the disk
    # from the models' own misses
    clock = FakeClock()
    router = _router(hf_checkpoints, names=("a",), clock=clock, experts=16, prefetch=prefetch)
    router.add_request(Request("r", "a", list(range(3, 40)), _params(2)))
    _run(router, clock, _finished(["r"]))
    router.residency.apply({"a": 0})
    before = router.models["a"].pool.stats()["prefetches"]
    router.residency.apply({"a": 16})
    router.models["a"].pool.wait_for_loads()
    started = router.models["a"].pool.stats()["prefetches"] - before
    assert (started > 0) == prefetch


def test_on_a_cpu_the_host_budget_joins_the_slots():
    config = RouterConfig(device_memory=1000, host_memory=500)
    assert config.one_ram_tier() == RouterConfig(device_memory=1500, host_memory=None)
    assert RouterConfig(host_memory=500).one_ram_tier().host_memory is None      # no limit
    assert RouterConfig(device_memory=1000).one_ram_tier() == RouterConfig(device_memory=1000)


@pytest.mark.parametrize("policy, ahead", [("rate", "all"), ("model-swap", "all"),
                                           ("lru", "none")])
def test_a_cold_start_reads_its_run_size_with_the_dense_weights(hf_checkpoints, policy, ahead):
    """rate reads a model it has no curve for whole (its run size), as model-swap does, on the
    loader thread; lru pages every expert on demand."""
    router = _router(hf_checkpoints, names=("a",), experts=16, policy=policy)
    router.add_request(Request("r", "a", [3], _params(1)))
    model = router.models["a"]
    for _ in range(100):                                         # bounded
        if model.state == ModelState.WARM:
            break
        assert router.wake.wait(30), "the load never landed"
        router.wake.clear()
        router.step()
    stats = model.pool.stats()
    assert stats["preloads"] == (16 if ahead == "all" else 0) and stats["prefetches"] == 0
    if policy == "model-swap":
        assert stats["misses"] == 0          # ready once all landed: its first step hits them
    if policy == "lru":
        assert stats["misses"] > 0           # (rate streams: a step may wait for a few)


def test_a_streamed_cold_start_gives_the_tokens_of_all_resident(hf_checkpoints):
    """rate's cold model runs while its preload is still landing (its steps wait for the
    experts they need, layer by layer): the same greedy tokens as with every expert resident."""
    path = hf_checkpoints["olmoe"][0]
    prompt = list(range(3, 20))
    expected = LLM(path, dtype="float32").generate(
        prompt_token_ids=[prompt], max_tokens=8, temperature=0.0, ignore_eos=True)[0].token_ids
    router = _router(hf_checkpoints, names=("a",), experts=16)
    router.add_request(Request("r", "a", prompt, _params(8)))
    outs = _run(router, None, _finished(["r"]))
    assert [t for o in outs["r"] for t in o.new_token_ids] == expected
    stats = router.models["a"].pool.stats()
    assert stats["preloads"] == 16 and stats["prefetches"] == 0
    router.models["a"].pool.check_integrity()


def test_a_busy_models_run_size_holds_for_its_turn(hf_checkpoints, monkeypatch):
    """The run size read from the curve may fall mid-turn (a short history undershoots): the
    view keeps the turn's until the model goes idle; a rise is taken at once."""
    clock = FakeClock()
    router = _router(hf_checkpoints, names=("a",), clock=clock, experts=16)
    learned = {"a": 16}
    monkeypatch.setattr("mox.router.views.run_slots", lambda *args: learned["a"])
    router.add_request(Request("a-1", "a", [3, 4, 5], _params(40)))
    _run(router, clock, lambda outs: len(outs.get("a-1", [])) >= 3)
    run_size = lambda: next(m.run_slots for m in router._view().models if m.name == "a")
    learned["a"] = 6                      # the curve's knee falls while a is busy
    assert run_size() == 16
    _run(router, clock, lambda outs: len(outs.get("a-1", [])) >= 5)
    assert router.timeline.records[-1].run_slots == 16
    assert router.timeline.records[-1].slots == router.models["a"].pool.num_slots
    _run(router, clock, _finished(["a-1"]))
    router.add_request(Request("a-2", "a", [3, 4], _params(8)))       # a new turn
    assert run_size() == 6
    learned["a"] = 12                     # ... whose run size rises with the curve
    assert run_size() == 12
    learned["a"] = 8
    assert run_size() == 12


def test_parking_drops_a_models_decode_graphs_and_its_next_turn_captures_anew(
        hf_checkpoints, monkeypatch):
    """Decode graphs (the GPU's, stood in for on the CPU: mox.models.decode_graphs) follow the
    router: captured in a warm model's first decode steps, dropped when it is parked, and
    captured anew, and counted in the step log, when it comes back."""
    from mox.kernels import triton_ops
    from mox.models import loading
    from mox.models.decode_graphs import EagerCapture
    monkeypatch.setattr(triton_ops, "takes", lambda x: True)
    monkeypatch.setattr(loading, "default_capture", lambda device: EagerCapture())
    clock = FakeClock()
    router = _router(hf_checkpoints, names=("a",), clock=clock, experts=16, dense_idle_s=30.0)
    pool = router.models["a"].pool
    pool.maps_host_experts = True                  # the table path (every expert resident)
    tokens = []
    for turn in range(2):
        router.add_request(Request(f"a{turn}", "a", [3, 4, 5], _params(4)))
        outputs = _run(router, clock, _finished([f"a{turn}"]))
        tokens.append([t for out in outputs[f"a{turn}"] for t in out.new_token_ids])
        decoder = router.models["a"].decoder
        assert decoder.graphs.sizes == [1]
        assert pool.stats()["graph_captures"] == turn + 1
        clock.now += 31.0
        router.step()                                              # idle: parked
        assert router.models["a"].state == ModelState.COLD
        assert decoder.graphs.sizes == []                          # its graphs dropped
    assert tokens[0] == tokens[1] and len(tokens[0]) == 4
    captured = [r for r in router.timeline.records if r.capture_seconds > 0]
    assert len(captured) == 2 and all(r.num_seqs == 1 for r in captured)

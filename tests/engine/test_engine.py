"""The engine: batching equals one-at-a-time, the KV pool drains, preemption recomputes the
same tokens, no model starves, stop strings and seeds behave."""

from __future__ import annotations

import threading

import torch

from mox.engine import Engine, SchedulerConfig
from mox.loaders.threads import use_one_thread
from mox.messages import FinishReason, Request
from mox.router import Router, RouterConfig
from mox.sampling import SamplingParams
from tests.conftest import open_tiny, serve_loaded

MODELS = ("mixtral", "qwen3_moe", "olmoe")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _alone(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy, one sequence, outside the engine: the reference."""
    cache = model.new_cache()
    logits = model.forward(torch.tensor(prompt), cache)[-1]
    tokens = []
    for _ in range(num_tokens):
        tokens.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(tokens[-1:]), cache)[-1]
    return tokens


def _engine(hf_checkpoints, kv_bytes=64 << 20, max_batched_tokens=16, names=MODELS):
    engine = Engine(kv_bytes, block_size=4,
                    config=SchedulerConfig(max_batched_tokens=max_batched_tokens))
    models = {}
    for name in names:
        models[name] = open_tiny(hf_checkpoints[name][0])
        serve_loaded(engine, name, models[name])
    return engine, models


def _run(engine: Engine, check=None) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_work:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.kv_pool.check_integrity()
        if check:
            check(engine)
    return outputs


def _tokens(outs) -> list[int]:
    return [t for out in outs for t in out.new_token_ids]


def test_batched_generation_equals_one_at_a_time(hf_checkpoints):
    engine, models = _engine(hf_checkpoints)
    requests = []
    for i, name in enumerate(MODELS):           # 9 prompts of mixed lengths, 3 models
        vocab = models[name].spec.vocab_size
        for j, prompt in enumerate(_prompts(vocab, [3, 21, 9], seed=i)):
            requests.append(Request(f"{name}-{j}", name, prompt, GREEDY))
    for request in requests:
        engine.add_request(request)
    outputs = _run(engine)
    for request in requests:
        expected = _alone(models[request.model], request.prompt_token_ids, 10)
        assert _tokens(outputs[request.request_id]) == expected, request.request_id
        assert outputs[request.request_id][-1].finish_reason == FinishReason.LENGTH
    assert engine.kv_pool.used_bytes == 0 and engine.num_live == 0


def test_preemption_recomputes_the_same_tokens_and_the_pool_drains(hf_checkpoints):
    engine, models = _engine(hf_checkpoints, names=("olmoe",))
    block = engine.models["olmoe"].runner.kv.block_nbytes
    engine.kv_pool.budget_bytes = 12 * block           # room for ~2 of the 6 sequences
    prompts = _prompts(models["olmoe"].spec.vocab_size, [5, 8, 6, 7, 5, 9], seed=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", "olmoe", prompt, GREEDY))
    seqs = {rid: live.seq for rid, live in engine._live.items()}
    peak = []
    outputs = _run(engine, check=lambda e: peak.append(e.kv_pool.used_bytes))
    assert max(peak) <= engine.kv_pool.budget_bytes
    assert sum(s.num_preemptions for s in seqs.values()) > 0
    for i, prompt in enumerate(prompts):
        assert _tokens(outputs[f"r{i}"]) == _alone(models["olmoe"], prompt, 10)
    assert engine.kv_pool.used_bytes == 0


def test_aborts_free_kv_at_once(hf_checkpoints):
    engine, models = _engine(hf_checkpoints, names=("qwen3_moe",))
    for i in range(3):
        engine.add_request(Request(f"r{i}", "qwen3_moe", [1, 2, 3, 4, 5, 6], GREEDY))
    engine.step()
    engine.step()
    assert engine.kv_pool.used_bytes > 0
    for i in range(3):
        out = engine.abort(f"r{i}")
        assert out.finish_reason == FinishReason.ABORT
    assert engine.kv_pool.used_bytes == 0 and not engine.has_work
    assert engine.abort("r0") is None                  # already gone


def test_a_failing_step_ends_only_its_batch(hf_checkpoints):
    """A bug in one model's step aborts that batch's requests with the error; the other
    model's requests finish, and the KV pool drains."""
    engine, models = _engine(hf_checkpoints, names=("mixtral", "qwen3_moe"))

    def broken(batch, interrupt):
        raise RuntimeError("a bug")
        yield                                      # a generator, as the runner's steps are

    engine.models["mixtral"].runner.steps = broken
    engine.add_request(Request("bad", "mixtral", [1, 2, 3], GREEDY))
    engine.add_request(Request("good", "qwen3_moe", [1, 2, 3], GREEDY))
    outputs = _run(engine)
    assert outputs["bad"][-1].finish_reason == FinishReason.ABORT
    assert isinstance(engine.take_error("bad"), RuntimeError)
    assert len(_tokens(outputs["good"])) == GREEDY.max_tokens
    assert engine.kv_pool.used_bytes == 0


def test_no_model_starves_and_an_idle_model_is_served(hf_checkpoints):
    engine, models = _engine(hf_checkpoints)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(Request(f"a{i}", "mixtral", [1, 2, 3], long))
        engine.add_request(Request(f"b{i}", "qwen3_moe", [4, 5, 6], long))
    progress = {"mixtral": 0, "qwen3_moe": 0, "olmoe": 0}
    finished_at = {}
    for step in range(400):
        if step == 10:                                 # a request to the idle third model
            engine.add_request(Request("c", "olmoe", [7, 8], GREEDY))
        for out in engine.step():
            model = {"a": "mixtral", "b": "qwen3_moe", "c": "olmoe"}[out.request_id[0]]
            progress[model] += len(out.new_token_ids)
            if out.finish_reason is not None:
                finished_at[out.request_id] = step
        if step == 30:
            assert progress["mixtral"] > 0 and progress["qwen3_moe"] > 0
        if not engine.has_work:
            break
    assert finished_at["c"] < min(finished_at[f"a{i}"] for i in range(3))
    assert finished_at["c"] < min(finished_at[f"b{i}"] for i in range(3))
    assert len(finished_at) == 7 and engine.kv_pool.used_bytes == 0


def test_seeded_sampling_is_reproducible_in_a_batch(hf_checkpoints):
    def run(seed_b: int) -> list[int]:
        engine, _ = _engine(hf_checkpoints, names=("olmoe",))
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
        engine.add_request(Request("a", "olmoe", [3, 4, 5], params))
        engine.add_request(Request("b", "olmoe", [9, 9], SamplingParams(
            max_tokens=12, temperature=1.0, seed=seed_b, ignore_eos=True)))
        return _tokens(_run(engine)["a"])
    assert run(1) == run(2)        # a's seed alone decides its tokens, whatever shares the batch


def test_padded_and_flat_attention_layouts_agree(hf_checkpoints):
    engine, models = _engine(hf_checkpoints, names=("mixtral",), max_batched_tokens=64)
    for i, prompt in enumerate(_prompts(models["mixtral"].spec.vocab_size, [4, 11, 7], 5)):
        engine.add_request(Request(f"r{i}", "mixtral", prompt, GREEDY))
    for _ in range(3):                            # prefill, then decodes: several sequences
        engine.step()
    batch = engine.scheduler.schedule()
    runner = engine.models["mixtral"].runner
    forward = runner.build(batch)
    assert forward.padded_layout() is not None    # decodes: per-sequence rows are cheaper
    padded = models["mixtral"].forward_batch(forward)
    forward.padded = None                         # same batch, flat block-diagonal mask
    torch.testing.assert_close(models["mixtral"].forward_batch(forward), padded,
                               atol=1e-5, rtol=1e-5)

def test_a_router_steps_on_its_threads_whatever_a_worker_sets(hf_checkpoints):
    """A worker's torch.set_num_threads(1) reaches every thread that never set its own count
    (OpenMP backend): the engine's step pins the count it was given."""
    before = torch.get_num_threads()
    path = hf_checkpoints["olmoe"][0]
    router = Router({"m": path}, RouterConfig(dtype="float32", compute_threads=3))
    try:
        router.warm_up("m")
        router.add_request(Request("r", "m", [1, 2, 3], SamplingParams(max_tokens=3)))
        for _ in range(10):                                   # bounded
            if not router.has_work:
                break
            worker = threading.Thread(target=use_one_thread)
            worker.start()
            worker.join()
            router.step()
            assert torch.get_num_threads() == 3
        assert not router.has_work
    finally:
        router.shutdown()
        torch.set_num_threads(before)


def test_the_engine_leaves_the_cores_its_neighbours_use(monkeypatch):
    import mox.engine.threads as threads

    samples = iter([threads.CpuTimes(busy, 0.0, own)                     # machine, own
                    for busy, own in [(0.0, 0.0), (4.0, 1.9), (8.0, 5.1), (12.0, 7.1)]])
    monkeypatch.setattr(threads, "cpu_times", lambda: next(samples))
    clock = iter([0.0, 2.0, 4.0, 6.0])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    cores = threads.SharedCores(max_threads=2, period_s=1.0)
    assert cores.current() == 1          # neighbours used 2.1 CPU-s in 2 s: one core is taken
    assert cores.current() == 2          # then 0.8 CPU-s in 2 s: under half a core, left to us
    assert cores.current() == 1          # 2.0 CPU-s in 2 s again
    monkeypatch.setattr(threads, "cpu_times", lambda: None)
    monkeypatch.setattr(threads.time, "monotonic", lambda: 100.0)
    assert threads.SharedCores(max_threads=4).current() == 4          # no /proc: every core


def test_the_engine_shares_up_to_the_ceiling_it_is_given(monkeypatch):
    """A fleet replica's process starts with Ray's one thread per reserved CPU; given the
    node's cores as its ceiling, its engine steps on all of them when no neighbour is busy."""
    import mox.engine.threads as threads

    monkeypatch.setattr(threads, "cpu_times", lambda: None)          # no neighbours to leave
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        Engine(16 << 20, max_threads=3).step()
        assert torch.get_num_threads() == 3
        Engine(16 << 20, compute_threads=2, max_threads=3).step()     # a fixed count wins
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)



def test_the_engine_steps_with_one_thread_fewer_while_reads_are_in_flight(monkeypatch):
    """The pager's I/O threads want a core while reads land: the engine's team shrinks by one
    then (never below one), and a count the operator fixed is kept."""
    import mox.engine.threads as threads

    monkeypatch.setattr(threads, "cpu_times", lambda: None)          # no neighbours to leave
    busy = [False]
    engine = Engine(16 << 20, io_busy=lambda: busy[0])
    engine._shared_cores = threads.SharedCores(max_threads=2)
    before = torch.get_num_threads()
    try:
        engine.step()
        assert torch.get_num_threads() == 2
        busy[0] = True
        engine.step()
        assert torch.get_num_threads() == 1
        engine._shared_cores = threads.SharedCores(max_threads=1)
        engine.step()
        assert torch.get_num_threads() == 1
        Engine(16 << 20, compute_threads=2, io_busy=lambda: True).step()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_sequence_with_nan_logits_fails_alone_and_its_batch_goes_on(hf_checkpoints):
    """One prompt's token embeds as NaN: that sequence ends with the NaN error; the other,
    in the same batch, gives the tokens it gives alone."""
    engine, models = _engine(hf_checkpoints, names=("olmoe",))
    model = models["olmoe"]
    good = [5, 6, 8]
    reference = _alone(model, good, 10)
    poison = next(t for t in range(model.spec.vocab_size) if t not in good + reference)
    bad = [5, 6, poison]
    model.embed[poison] = float("nan")
    engine.add_request(Request("bad", "olmoe", bad, GREEDY))
    engine.add_request(Request("good", "olmoe", good, GREEDY))
    outputs = _run(engine)
    assert outputs["bad"][-1].finish_reason == FinishReason.ABORT
    assert "NaN" in outputs["bad"][-1].error and "NaN" in str(engine.take_error("bad"))
    assert _tokens(outputs["good"]) == reference
    assert engine.kv_pool.used_bytes == 0

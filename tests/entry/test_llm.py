"""The offline API on the demo checkpoints (bf16, as served)."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from mox import LLM
from mox.errors import InvalidRequestError, MoxError


@pytest.fixture(scope="module")
def llm(demo_home):
    return LLM(os.path.join(demo_home, "models", "qwen3-moe-demo"))


def test_generates_text_from_prompts(llm):
    outs = llm.generate(["Hello, my name is", "The capital of France"], max_tokens=8,
                        temperature=0.0, ignore_eos=True)
    assert len(outs) == 2
    for out in outs:
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids) and out.text


def test_prompts_and_token_ids_give_the_same_greedy_result(llm):
    ids = llm.tokenizer.encode("Hello world")
    by_text = llm.generate("Hello world", max_tokens=6, temperature=0.0)[0]
    by_ids = llm.generate(prompt_token_ids=[ids], max_tokens=6, temperature=0.0)[0]
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt_token_ids == ids


def test_one_call_takes_more_prompts_than_a_servers_queue(llm):
    """vLLM's LLM takes any number of prompts; the server's queue limit (256 a model) and
    timeout are a server's, not the offline API's."""
    outs = llm.generate(prompt_token_ids=[[3 + i % 50] for i in range(300)], max_tokens=1,
                        temperature=0.0)
    assert len(outs) == 300 and all(len(o.token_ids) == 1 for o in outs)


def test_seeded_sampling_is_reproducible(llm):
    run = lambda seed: llm.generate("Once upon a time", max_tokens=10, temperature=1.0,
                                    top_p=0.9, seed=seed)[0].token_ids
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_stop_token_ends_generation(llm):
    greedy = llm.generate("Hello", max_tokens=10, temperature=0.0, ignore_eos=True)[0]
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    out = llm.generate("Hello", max_tokens=10, temperature=0.0, stop_token_ids=[stop_at])[0]
    assert out.token_ids == greedy.token_ids[:first + 1] and out.finish_reason == "stop"
    # its text leaves the stop token's out, as vLLM's does
    before = "" if first == 0 else llm.generate("Hello", max_tokens=first, temperature=0.0,
                                                ignore_eos=True)[0].text
    assert out.text == before


def test_stop_string_truncates_text(llm):
    greedy = llm.generate("Hello", max_tokens=12, temperature=0.0, ignore_eos=True)[0]
    stop = greedy.text[len(greedy.text) // 2:][:2]
    out = llm.generate("Hello", max_tokens=12, temperature=0.0, stop=[stop], ignore_eos=True)[0]
    assert out.finish_reason == "stop"
    assert out.text == greedy.text[:greedy.text.find(stop)]
    assert stop not in out.text


def test_eos_ends_generation_unless_ignored(llm, monkeypatch):
    greedy = llm.generate("Hello", max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    eos = greedy.token_ids[2]
    first = greedy.token_ids.index(eos)
    monkeypatch.setattr(llm.engine.models[llm.name], "eos_token_ids", (eos,))
    out = llm.generate("Hello", max_tokens=8, temperature=0.0)[0]
    assert out.token_ids == greedy.token_ids[:first + 1] and out.finish_reason == "stop"
    # its text leaves the stop token's out, as vLLM's does
    before = "" if first == 0 else llm.generate("Hello", max_tokens=first, temperature=0.0,
                                                ignore_eos=True)[0].text
    assert out.text == before
    ignored = llm.generate("Hello", max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    assert ignored.token_ids == greedy.token_ids and ignored.finish_reason == "length"


def test_eos_ids_come_from_the_checkpoint(llm):
    assert llm.eos_token_ids == (llm.tokenizer.eos_token_id,)


def test_generation_configs_sampling_defaults_apply_offline_too(demo_home, tmp_path):
    """As the server (and vLLM's LLM): a greedy generation_config makes an unset temperature
    greedy; a given one wins."""
    model = tmp_path / "greedy"
    shutil.copytree(os.path.join(demo_home, "models", "qwen3-moe-demo"), model)
    (model / "generation_config.json").write_text('{"temperature": 0.0}')
    llm = LLM(str(model))
    greedy = llm.generate("Hello", max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    assert all(llm.generate("Hello", max_tokens=8, seed=s, ignore_eos=True)[0].token_ids
               == greedy.token_ids for s in (1, 2))
    sampled = {tuple(llm.generate("Hello", max_tokens=8, temperature=1.0, seed=s,
                                  ignore_eos=True)[0].token_ids) for s in (1, 2, 3)}
    assert sampled != {tuple(greedy.token_ids)}


@pytest.mark.parametrize("kwargs,match", [
    (dict(), "exactly one"),
    (dict(prompts="a", prompt_token_ids=[[1]]), "exactly one"),
    (dict(prompt_token_ids=[[]]), "empty prompt"),
    (dict(prompt_token_ids=[[10**9]]), "token ids"),
    (dict(prompts="a", max_tokens=0), "max_tokens"),
    (dict(prompts="a", max_tokens=2.5), "max_tokens must be an integer"),
    (dict(prompts="a", temperature=float("nan")), "temperature must be a finite"),
    (dict(prompts="a", top_k="5"), "top_k must be an integer"),
    (dict(prompts="a", seed=1.5), "seed"),
    (dict(prompts="a", stop=[3]), "stop must be strings"),
    (dict(prompts=["a", 7]), "prompts must be"),
    (dict(prompt_token_ids=[1, 2]), "list of lists"),
])
def test_bad_requests_are_refused(llm, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(**kwargs)


def test_prompt_longer_than_context_is_refused(llm):
    too_long = [1] * llm.model.spec.max_position_embeddings
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate(prompt_token_ids=[too_long])


def test_float16_on_cpu_is_refused(demo_home):
    with pytest.raises(InvalidRequestError, match="float16"):
        LLM(os.path.join(demo_home, "models", "olmoe-demo"), dtype="float16")


def test_logprobs_of_chosen_tokens(llm):
    out = llm.generate("Hello", max_tokens=6, temperature=0.0, ignore_eos=True,
                       logprobs=True)[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    assert all(lp <= 0.0 for lp in out.logprobs)
    assert llm.generate("Hello", max_tokens=6, temperature=0.0)[0].logprobs is None


def test_many_prompts_batch_and_equal_single_runs(llm):
    prompts = ["Hello", "The capital of France", "Once upon a time there was", "A"]
    batched = llm.generate(prompts, max_tokens=6, temperature=0.0, ignore_eos=True)
    single = [llm.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True)[0]
              for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]
    assert llm.engine.kv_pool.used_bytes == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_fail_the_request_with_a_clear_error(llm, temperature):
    """Greedy decoding would take token 0 from NaN logits, sampling would fail in
    torch.multinomial; both name the cause instead."""
    head = llm.model.lm_head
    saved = head.clone()
    head.fill_(float("nan"))
    try:
        with pytest.raises(MoxError, match="logits are NaN"):
            llm.generate(prompts="hello", max_tokens=2, temperature=temperature)
    finally:
        head.copy_(saved)
    assert llm.generate(prompts="hello", max_tokens=2)[0].token_ids    # serving goes on


def test_a_sequence_the_kv_pool_ends_keeps_its_held_back_text(demo_home):
    """Ended by a full pool (its context limit here), a sequence's text is all its tokens'
    text, as when max_tokens ends it: the stop-string look-behind the detokenizer held back
    is flushed."""
    llm = LLM(os.path.join(demo_home, "models", "olmoe-demo"), kv_memory="256KiB")
    kwargs = dict(prompt_token_ids=[[5, 6, 7]], temperature=0.0, ignore_eos=True)
    [free] = llm.generate(max_tokens=4000, **kwargs)
    assert free.finish_reason == "length" and len(free.token_ids) < 4000   # the pool ended it
    [held] = llm.generate(max_tokens=4000, stop=["\x1e\u2603 never"], **kwargs)
    assert held.token_ids == free.token_ids
    assert held.text == free.text == llm.tokenizer.decode(free.token_ids)


def test_generate_from_two_threads_gives_each_its_own_outputs(llm):
    """Calls on two threads run one after the other: each gets its own results, as alone."""
    prompts = {0: [[5, 6, 7], [8, 9]], 1: [[10, 11, 12, 13]]}
    kwargs = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = {k: [o.token_ids for o in llm.generate(prompt_token_ids=p, **kwargs)]
             for k, p in prompts.items()}
    got, errors = {}, []

    def run(k: int) -> None:
        try:
            got[k] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts[k], **kwargs)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert got == alone


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "mps"])
def test_a_device_mox_cannot_use_is_refused(demo_home, device):
    with pytest.raises(InvalidRequestError, match="device|cpu or cuda"):
        LLM(os.path.join(demo_home, "models", "olmoe-demo"), device=device)


def test_a_registered_name_is_found_in_the_home_given(tmp_path, demo_home, capsys):
    from mox.cli import main
    from mox.registry import Registry

    home = str(tmp_path / "home")
    Registry(home).add("mine", os.path.join(demo_home, "models", "olmoe-demo"))
    assert LLM("mine", home=home).checkpoint.path.endswith("olmoe-demo")
    assert main(["generate", "Hi", "--model", "mine", "--max-tokens", "2", "--home", home]) == 0
    assert "[mine] Hi" in capsys.readouterr().out

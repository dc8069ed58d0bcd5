"""Request decoding, parameter checks and chat templates, without a server."""

from __future__ import annotations

import json
import os

import pytest

from mox.errors import InvalidRequestError
from mox.sampling import generation_defaults
from mox.server.chat_template import ChatTemplate
from mox.server.limits import ServerLimits
from mox.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_sampling_params,
    completion_prompt,
    completion_sampling_params,
    decode_body,
)


def _completion(**fields) -> CompletionRequest:
    return decode_body(json.dumps({"model": "m", "prompt": "hi", **fields}).encode(),
                       CompletionRequest)


def _chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(json.dumps(body).encode(), ChatCompletionRequest)


@pytest.mark.parametrize("body, param", [
    (b'{"model": "m", "prompt": ', None),                              # malformed JSON
    (b'[1, 2]', None),                                                  # not an object
    (b'{"prompt": "hi"}', "model"),                                     # missing field
    (b'{"model": "m", "prompt": "hi", "temperature": "hot"}', "temperature"),
    (b'{"model": "m", "prompt": 5}', "prompt"),
    (b'{"model": "m", "prompt": "hi", "stream_options": {"include_usage": 1}}',
     "stream_options.include_usage"),
])
def test_bad_bodies_name_the_parameter(body, param):
    with pytest.raises(InvalidRequestError) as e:
        decode_body(body, CompletionRequest)
    assert e.value.param == param


def test_chat_path_names_the_message():
    body = b'{"model": "m", "messages": [{"role": "user", "content": 3}]}'
    with pytest.raises(InvalidRequestError) as e:
        decode_body(body, ChatCompletionRequest)
    assert e.value.param == "messages[0].content"


def test_unknown_fields_are_ignored_and_defaults_apply():
    request = _completion(frobnicate=True, user="u1", nested={"x": [1]})
    params = completion_sampling_params(request)
    assert params.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS and params.temperature == 1.0
    assert chat_sampling_params(_chat()).max_tokens == ServerLimits().default_max_tokens


def test_chat_without_a_limit_gets_the_servers_default_and_every_limit_is_capped():
    limits = ServerLimits(default_max_tokens=7, max_tokens_cap=100)
    assert chat_sampling_params(_chat(), limits).max_tokens == 7
    assert chat_sampling_params(_chat(max_tokens=100), limits).max_tokens == 100
    for make, param in ((_chat, "max_completion_tokens"), (_completion, "max_tokens")):
        params = chat_sampling_params if make is _chat else completion_sampling_params
        with pytest.raises(InvalidRequestError) as e:
            params(make(**{param: 101}), limits)
        assert e.value.param == param and "100" in str(e.value)


@pytest.mark.parametrize("opener, closer", [(b'{"a":', b"}"), (b"[", b"]")])
def test_deeply_nested_json_is_a_400_not_a_crash(opener, closer):
    depth = 10_000
    body = b'{"model": "m", "prompt": "x", "extra": ' + opener * depth + b"1" + closer * depth
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        decode_body(body + b"}", CompletionRequest)


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 2.5}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 2}, "n"), ({"top_k": 0}, "top_k"), ({"stop": ["ok", ""]}, "stop"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logprobs": 3}, "logprobs"),
    ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"), ({"seed": 2**64}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"stop": ""}, "stop"),
    ({"repetition_penalty": 1.5}, "repetition_penalty"), ({"min_p": 0.1}, "min_p"),
    ({"min_tokens": 4}, "min_tokens"), ({"use_beam_search": True}, "use_beam_search"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
])
def test_out_of_range_values_are_refused(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        completion_sampling_params(_completion(**fields))
    assert e.value.param == param


def test_vllm_extensions_at_their_defaults_are_accepted():
    params = completion_sampling_params(_completion(
        repetition_penalty=1.0, min_p=0.0, min_tokens=0, use_beam_search=False,
        include_stop_str_in_output=False, prompt_logprobs=None, guided_json=None))
    assert params.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS


def test_a_lower_cap_lowers_the_completions_default():
    limits = ServerLimits(default_max_tokens=8, max_tokens_cap=8)
    assert completion_sampling_params(_completion(), limits).max_tokens == 8


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages[1].tool_calls"),
])
def test_tool_use_is_refused_not_dropped(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        chat_sampling_params(_chat(**fields))
    assert e.value.param == param


@pytest.mark.parametrize("fields, param", [
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"documents": [{"text": "d"}]}, "documents"),
    ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
])
def test_vllm_chat_template_extensions_are_refused_unless_default(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        chat_sampling_params(_chat(**fields))
    assert e.value.param == param
    assert chat_sampling_params(_chat(add_generation_prompt=True, skip_special_tokens=True,
                                      continue_final_message=False)).max_tokens > 0


def test_tool_choice_none_and_parallel_tool_calls_without_tools_are_accepted():
    params = chat_sampling_params(_chat(tool_choice="none", parallel_tool_calls=False))
    assert params.max_tokens == ServerLimits().default_max_tokens


def test_sampling_params_carry_the_request():
    params = completion_sampling_params(_completion(
        max_tokens=7, temperature=0, top_p=0.5, seed=3, stop="x", logprobs=0, top_k=4,
        ignore_eos=True, stop_token_ids=[9]))
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (7, 0, 0.5, 3)
    assert params.stop == ("x",) and params.logprobs and params.top_k == 4
    assert params.ignore_eos and params.stop_token_ids == (9,)


def test_chat_prefers_max_completion_tokens():
    assert chat_sampling_params(_chat(max_tokens=5, max_completion_tokens=9)).max_tokens == 9
    with pytest.raises(InvalidRequestError) as e:
        chat_sampling_params(_chat(max_completion_tokens=0))
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(InvalidRequestError) as e:
        chat_sampling_params(_chat(tools=[{"type": "function"}]))
    assert e.value.param == "tools"


@pytest.mark.parametrize("prompt, expected", [
    ("hello", "hello"), ([1, 2, 3], [1, 2, 3]), (["hello"], "hello"), ([[4, 5]], [4, 5]),
])
def test_prompt_forms(prompt, expected):
    assert completion_prompt(prompt) == expected


@pytest.mark.parametrize("prompt", [[], ["a", "b"], [1, "a"], [""], [[]]])
def test_batched_or_empty_prompts_are_refused(prompt):
    with pytest.raises(InvalidRequestError) as e:
        completion_prompt(prompt)
    assert e.value.param == "prompt"


def test_content_parts_are_joined_and_other_parts_refused():
    chat = _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "text", "text": "b"}]}])
    assert chat.messages[0].as_template_input() == {"role": "user", "content": "a\nb"}
    image = _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(InvalidRequestError, match="only text"):
        image.messages[0].as_template_input()
    empty = _chat(messages=[{"role": "user", "content": [{"type": "text"}]}])
    with pytest.raises(InvalidRequestError, match="needs its `text`"):
        empty.messages[0].as_template_input()


@pytest.mark.parametrize("role", ["bogus", "tool", "function"])
def test_a_role_mox_cannot_serve_is_refused(role):
    with pytest.raises(InvalidRequestError) as e:
        _chat(messages=[{"role": role, "content": "hi"}])
    assert e.value.param == "messages[0].role"
    assert _chat(messages=[{"role": "developer", "content": "hi"}]).messages[0].role == "developer"


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_demo_checkpoint_template_is_chatml(demo_home):
    template = ChatTemplate.from_checkpoint(os.path.join(demo_home, "models", "olmoe-demo"))
    assert template.special_tokens["eos_token"] == "<|endoftext|>"
    assert template.render(MESSAGES) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                         "<|im_start|>user\nHi<|im_end|>\n"
                                         "<|im_start|>assistant\n")


def _checkpoint_with(tmp_path, config: dict) -> str:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_template_list_bos_and_raise_exception(tmp_path):
    source = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
              "{{ raise_exception('no system role') }}{% endif %}[{{ m['content'] }}]"
              "{% endfor %}")
    path = _checkpoint_with(tmp_path, {"bos_token": {"content": "<s>"}, "chat_template": [
        {"name": "tool_use", "template": "unused"}, {"name": "default", "template": source}]})
    template = ChatTemplate.from_checkpoint(path)
    assert template.render([{"role": "user", "content": "x"}]) == "<s>[x]"
    with pytest.raises(InvalidRequestError, match="no system role") as e:
        template.render(MESSAGES)
    assert e.value.param == "messages"


def test_a_missing_or_broken_template_refuses_chat_naming_why(tmp_path):
    with pytest.raises(InvalidRequestError, match="no chat template .* use /v1/completions"):
        ChatTemplate.from_checkpoint(str(tmp_path)).render(MESSAGES)
    broken = ChatTemplate.from_checkpoint(_checkpoint_with(
        tmp_path, {"chat_template": "{% for m in messages %}\n{{ m }"}))
    with pytest.raises(InvalidRequestError, match=r"tokenizer_config.json\) is invalid: .* "
                                                  r"\(line 2\)"):
        broken.render(MESSAGES)
    unnamed = ChatTemplate.from_checkpoint(_checkpoint_with(
        tmp_path, {"chat_template": [{"name": "tool_use", "template": "x"}]}))
    with pytest.raises(InvalidRequestError, match=r"named \['tool_use'\] but none 'default'"):
        unnamed.render(MESSAGES)


def test_sandbox_refuses_unsafe_templates():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        template.render(MESSAGES)


@pytest.mark.parametrize("source", ["{{ 1 / 0 }}", "{{ messages[0]['content'] + 1 }}"])
def test_a_template_failing_as_it_renders_is_a_400(tmp_path, source):
    template = ChatTemplate.from_checkpoint(_checkpoint_with(tmp_path, {"chat_template": source}))
    with pytest.raises(InvalidRequestError, match="chat template failed") as e:
        template.render(MESSAGES)
    assert e.value.param == "messages"


def test_a_models_generation_config_sets_what_a_request_leaves_out():
    # transformers' own defaults (temperature 1, top_p 1, top_k 50) set nothing, as in vLLM;
    # top_k 0 is off; values no request could give are left out
    assert generation_defaults({"temperature": 1.0, "top_p": 1.0, "top_k": 50}) == {}
    assert generation_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                "do_sample": True}) == {"temperature": 0.6, "top_p": 0.95,
                                                        "top_k": 20}
    assert generation_defaults({"top_k": 0, "top_p": 0.0, "temperature": "hot"}) == {"top_k": -1}
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    for make, build in ((_completion, completion_sampling_params), (_chat, chat_sampling_params)):
        params = build(make(), ServerLimits(), defaults)
        assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
        params = build(make(temperature=0.0, top_p=0.5, top_k=3), ServerLimits(), defaults)
        assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.5, 3)
        params = build(make(), ServerLimits())                  # none: the server's
        assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1)

"""The chat prompt as transformers builds it on the same folder (`apply_chat_template`, then
its tokens): where the template comes from, the environment it runs in, and the special
tokens the encoding adds (a prompt's, not a rendered chat's)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from mox.server.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate
from mox.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
# what published templates use beyond plain loops: break/continue, tojson's options, the
# special tokens other than bos/eos, training-mask blocks
FEATURES = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{{ m['role'] }}:{% generation %}{{ m['content'] | tojson(ensure_ascii=False) }}"
    "{% endgeneration %}{{ pad_token }}|{{ unk_token }}\n"
    "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    "{{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=True, separators=(',', ':')) }}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture()
def folder(tmp_path, demo_home):
    """The demo tokenizer, with a pad and an unk token and a template in tokenizer_config."""
    source = os.path.join(demo_home, "models", "olmoe-demo")
    shutil.copy(os.path.join(source, TOKENIZER_FILE), tmp_path)
    with open(os.path.join(source, TOKENIZER_CONFIG_FILE)) as f:
        config = json.load(f)
    config.update(pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    _write_config(tmp_path, config)
    return tmp_path


def _write_config(folder, config: dict) -> None:
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config))


def _config(folder) -> dict:
    return json.loads((folder / TOKENIZER_CONFIG_FILE).read_text())


def _transformers_prompt(folder) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_the_template_environment_is_transformers(folder):
    _write_config(folder, {**_config(folder), "chat_template": FEATURES})
    rendered = ChatTemplate.from_checkpoint(str(folder)).render(MESSAGES)
    assert rendered == _transformers_prompt(folder)
    assert '"Hi ✓"<|endoftext|>|<|endoftext|>' in rendered and '{"a":[1,2],"b":1}' in rendered


def test_chat_template_jinja_wins_over_the_config(folder):
    _write_config(folder, {**_config(folder), "chat_template": "config: {{ messages[0] }}"})
    (folder / CHAT_TEMPLATE_FILE).write_text(FEATURES)
    assert ChatTemplate.from_checkpoint(str(folder)).render(MESSAGES) == \
        _transformers_prompt(folder)
    (folder / CHAT_TEMPLATE_FILE).write_text("{% for m in messages %}")        # broken
    with pytest.raises(Exception, match=CHAT_TEMPLATE_FILE):
        ChatTemplate.from_checkpoint(str(folder)).render(MESSAGES)
    (folder / CHAT_TEMPLATE_FILE).unlink()                 # a folder of that name: skipped
    (folder / CHAT_TEMPLATE_FILE).mkdir()
    assert ChatTemplate.from_checkpoint(str(folder)).render(MESSAGES).startswith("config: ")


def test_a_prompt_gets_the_post_processors_tokens_and_a_chat_none(folder):
    """A tokenizer.json whose post-processor adds bos (Llama 3, DeepSeek): `tokenizer(text)`
    gets it and a rendered chat (which writes its own) does not; `add_bos_token` in
    tokenizer_config.json changes neither, as in transformers."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer

    bos = "<|endoftext|>"
    hf = HFTokenizer.from_file(str(folder / TOKENIZER_FILE))
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, hf.token_to_id(bos))])
    hf.save(str(folder / TOKENIZER_FILE))
    for add_bos in (True, False):
        _write_config(folder, {**_config(folder), "add_bos_token": add_bos, "bos_token": bos})
        ours, theirs = Tokenizer(str(folder / TOKENIZER_FILE)), AutoTokenizer.from_pretrained(
            str(folder))
        assert ours.encode("Hello world") == theirs("Hello world").input_ids
        assert ours.encode("Hello world")[0] == hf.token_to_id(bos)
        chat = _transformers_prompt(folder)
        assert ours.encode(chat, special_tokens=False) == theirs(
            chat, add_special_tokens=False).input_ids

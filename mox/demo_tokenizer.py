"""A real byte-level BPE tokenizer for the demo models, trained with the `tokenizers` library
on a small built-in corpus (deterministic: same corpus, same merges), with a ChatML
chat template in tokenizer_config.json."""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mox.loaders.writer import write_json_atomic

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
Hello! This is mox, a server for many mixture-of-experts language models on one machine.
A mixture-of-experts model sends each token to a few experts out of many in every layer.
Most models are cold: they see a request now and then, so keeping them in memory is waste.
Loading a whole model for each cold request wastes seconds; mox pages experts instead.
The router tracks how often each model is asked and divides one memory budget among them.
The expert pager reads cold experts from disk into slots and keeps the popular ones.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Once upon a time there was a small model that wanted to answer every question it heard.
What is the capital of France? Paris is the capital of France, on the river Seine.
How are you today? I am fine, thank you. Tell me a story about the sea and the stars.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000, and dates like 2026-11-30 appear in text too.
def generate(prompt, max_tokens=16): return model.sample(prompt, temperature=0.7)
The weather is sunny with a light breeze; tomorrow brings rain over the hills.
Questions, answers, requests and replies: the server streams every token as it comes.
"""


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    return tokenizer


def write_tokenizer(out_dir: str, tokenizer: Tokenizer) -> None:
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    write_json_atomic(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    })

"""Incremental text: the detokenizer never splits a character and finds stop strings."""

from __future__ import annotations

import os

import pytest

from mox.engine.detokenizer import INCOMPLETE_CHAR, IncrementalDetokenizer
from mox.loaders.errors import CheckpointError
from mox.tokenizer import Tokenizer
from tests.conftest import byte_fallback_tokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_home):
    return Tokenizer(os.path.join(demo_home, "models", "olmoe-demo", "tokenizer.json"))


def test_multibyte_characters_are_never_split(tokenizer):
    text = "Héllo wörld, 日本語のテキスト, emoji 🙂 and more."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=())
    deltas = [detok.push([t]) for t in ids]
    assert all(INCOMPLETE_CHAR not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert any(d == "" for d in deltas)          # some token ended mid-character and waited


def test_stop_string_spanning_tokens_is_found(tokenizer):
    text = "The weather is sunny with a light breeze"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    # a stop string made of the end of one token and the start of the next
    i = next(i for i in range(len(pieces) - 1) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 1)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    detok = IncrementalDetokenizer(tokenizer, stop=(stop,))
    emitted = ""
    for t in ids:
        emitted += detok.push([t])
        if detok.stopped:
            break
    assert detok.stopped and emitted == text[:text.find(stop)]


def test_sentencepiece_text_streams_as_it_decodes_and_never_stalls(tmp_path):
    tok = Tokenizer(byte_fallback_tokenizer(tmp_path))
    stream = lambda ids: "".join(detok.push([t], final=i == len(ids) - 1)
                                 for detok in [IncrementalDetokenizer(tok, stop=())]
                                 for i, t in enumerate(ids))
    hi = [257, 258]                          # "▁h", "i": its space only after a token
    assert stream(hi * 3) == tok.decode(hi * 3) == "hi hi hi"
    # after a prompt, the output's first word keeps its space (decoded alone, it loses it)
    detok = IncrementalDetokenizer(tok, stop=(), prompt_ids=hi)
    assert "".join(detok.push([t]) for t in hi) == " hi" == tok.decode(hi * 2)[len("hi"):]
    # a special token decodes to nothing: the next word keeps its space
    assert stream([*hi, 259, *hi]) == tok.decode([*hi, 259, *hi]) == "hi hi"
    # a sampled byte turns the byte before it invalid: "I" (0x49) is out already, the decoder
    # now reads both as U+FFFD; the text goes on after it (it had stopped for good)
    ids = [1 + 0x49, 1 + 0xA4, *hi * 2]
    assert tok.decode(ids) == "�� hi hi"
    assert stream(ids) == "I� hi hi"


def test_a_dangling_tokenizer_link_is_a_damaged_checkpoint(tmp_path):
    """A checkpoint without tokenizer.json serves token ids only; one whose tokenizer.json is
    a dangling or looping link is damaged, and the error names the file."""
    assert Tokenizer.from_checkpoint(str(tmp_path)) is None
    (tmp_path / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_checkpoint(str(tmp_path))

"""Incremental text: the detokenizer never splits a character and finds stop strings."""

from __future__ import annotations

import os

import pytest

from mox.engine.detokenizer import INCOMPLETE_CHAR, IncrementalDetokenizer
from mox.loaders.errors import CheckpointError
from mox.tokenizer import Tokenizer


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


def test_a_dangling_tokenizer_link_is_a_damaged_checkpoint(tmp_path):
    """A checkpoint without tokenizer.json serves token ids only; one whose tokenizer.json is
    a dangling or looping link is damaged, and the error names the file."""
    assert Tokenizer.from_checkpoint(str(tmp_path)) is None
    (tmp_path / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_checkpoint(str(tmp_path))

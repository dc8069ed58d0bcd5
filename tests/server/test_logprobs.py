"""Logprobs name each token's own bytes and where its text starts, also for tokens that hold
part of a character (which decode alone to U+FFFD)."""

from __future__ import annotations

import os

import pytest

from mox.server.formatting import ChatFormat, CompletionFormat
from mox.tokenizer import Tokenizer
from tests.conftest import byte_fallback_tokenizer

TEXT = "Ȥ héllo → ✓ 日本"


@pytest.fixture(scope="module")
def byte_level(demo_home):
    return Tokenizer(os.path.join(demo_home, "models", "olmoe-demo", "tokenizer.json"))


def test_a_byte_level_tokens_bytes_are_its_own(byte_level):
    ids = byte_level.encode(TEXT)
    assert any("\ufffd" in byte_level.decode([t]) for t in ids)     # some split a character
    assert b"".join(byte_level.token_bytes(t) for t in ids) == TEXT.encode()


def test_sentencepiece_byte_fallback_pieces_are_their_bytes(tmp_path):
    tok = Tokenizer(byte_fallback_tokenizer(tmp_path))
    assert tok.token_bytes(1 + 0xE2) == b"\xe2"
    assert tok.token_bytes(257) == b" h" and tok.token_bytes(258) == b"i"


def test_chat_bytes_and_completion_offsets_follow_the_text(byte_level):
    ids = byte_level.encode(TEXT)
    chat = ChatFormat("c", "m", byte_level)._logprobs(ids, [-0.5] * len(ids))
    assert bytes(b for entry in chat.content for b in entry.bytes) == TEXT.encode()
    completion = CompletionFormat("c", "m", byte_level)._logprobs(ids, [-0.5] * len(ids))
    offsets = completion.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(TEXT)
    # each whole token's text starts at its offset in the text
    for token, offset in zip(completion.tokens, offsets):
        if "\ufffd" not in token:
            assert TEXT[offset:offset + len(token)] == token

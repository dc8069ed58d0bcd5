"""The checkpoint's `tokenizer.json`, through the `tokenizers` library."""

from __future__ import annotations

import json
import os
import re

from tokenizers import Tokenizer as HFTokenizer

from mox.errors import CheckpointError
from mox.loaders.json_files import read_json_object

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, which byte-level BPE vocabularies are written in: each
    byte as a printable character (printable Latin-1 bytes as themselves, the rest from
    U+0100 on), here mapped back to the byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


BYTE_LEVEL = _byte_level_alphabet()


class Tokenizer:
    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:   # tokenizers raises bare Exception subclasses for bad files
            raise CheckpointError(path, f"cannot load tokenizer: {e}") from e
        config = read_json_object(os.path.join(os.path.dirname(path),
                                               TOKENIZER_CONFIG_FILE)) or {}
        self.eos_token_id = self._token_id(config.get("eos_token"))
        added = self._tok.get_added_tokens_decoder()
        self._added = set(added)
        # the control tokens' text (<|im_start|>, <|im_end|>, ...), which encode() turns
        # into those tokens wherever it appears: one pattern, one pass over a text
        specials = sorted((t.content for t in added.values() if t.special), key=len,
                          reverse=True)
        self._control = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._pieces = _piece_kind(self._tok)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str) -> Tokenizer | None:
        path = os.path.join(checkpoint_dir, TOKENIZER_FILE)
        # (a dangling or looping symlink is a damaged checkpoint, not one without a tokenizer)
        return cls(path) if os.path.lexists(path) else None

    def _token_id(self, token: str | dict | None) -> int | None:
        text = token_text(token)
        return self._tok.token_to_id(text) if text is not None else None

    def control_text(self, text: str) -> str | None:
        """The first control token's text found in `text` (None: none): encoded, it would
        become that token, so text from a chat's messages must not hold it."""
        found = self._control.search(text) if self._control is not None else None
        return found.group() if found else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """`special_tokens`: what tokenizer.json's post-processor adds (a bos, for most), as
        transformers' `tokenizer(text)` adds them (`add_bos_token` in tokenizer_config.json
        changes nothing there either); a rendered chat holds its own, so it is encoded
        without them, as by `apply_chat_template` and vLLM's chat."""
        return self._tok.encode(text, add_special_tokens=special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (for logprobs): a byte-level token may hold part of a
        character, which decoding the token alone turns into U+FFFD."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None and token_id not in self._added:
            if self._pieces == "byte_level" and all(c in BYTE_LEVEL for c in piece):
                return bytes(BYTE_LEVEL[c] for c in piece)
            if self._pieces == "byte_fallback":
                byte = BYTE_FALLBACK_PIECE.fullmatch(piece)
                return (bytes([int(byte.group(1), 16)]) if byte
                        else piece.replace(SENTENCEPIECE_SPACE, " ").encode())
        return self.decode([token_id]).encode()


def token_text(token: str | dict | None) -> str | None:
    """A special token as tokenizer_config.json gives it -> its text (older configs store
    AddedToken dicts, {"content": ...}); None for anything else."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _piece_kind(tok: HFTokenizer) -> str:
    """How the vocabulary writes a token's bytes: "byte_level" (GPT-2's alphabet),
    "byte_fallback" (SentencePiece pieces, "<0xNN>" for single bytes) or "text"."""
    if tok.decoder is None:
        return "text"
    decoder = json.loads(tok.decoder.__getstate__())
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    return ("byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds
            else "text")



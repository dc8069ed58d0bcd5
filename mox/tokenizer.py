"""The checkpoint's `tokenizer.json`, through the `tokenizers` library."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as HFTokenizer

from mox.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class Tokenizer:
    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:   # tokenizers raises bare Exception subclasses for bad files
            raise CheckpointError(path, f"cannot load tokenizer: {e}") from e
        config = _read_json(os.path.join(os.path.dirname(path), TOKENIZER_CONFIG_FILE))
        self.add_bos = bool(config.get("add_bos_token", False))
        self.bos_token_id = self._token_id(config.get("bos_token"))
        self.eos_token_id = self._token_id(config.get("eos_token"))

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str) -> Tokenizer | None:
        path = os.path.join(checkpoint_dir, TOKENIZER_FILE)
        return cls(path) if os.path.exists(path) else None

    def _token_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):        # older configs store AddedToken dicts
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"unreadable JSON: {e}") from e

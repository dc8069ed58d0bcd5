"""A checkpoint's small JSON files (config.json, generation_config.json, tokenizer_config.json),
read one way: an object, or a CheckpointError that names the file."""

from __future__ import annotations

import json
import os

from mox.loaders.errors import CheckpointError


def read_json_object(path: str) -> dict | None:
    """The file's JSON object, or None where there is no file."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"unreadable JSON: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(path, f"not a JSON object (a {type(value).__name__})")
    return value

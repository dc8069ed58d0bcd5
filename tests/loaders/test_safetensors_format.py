"""Our header parser against the safetensors library, and its refusals of corrupt files."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from mox.loaders import CheckpointError, read_header
from mox.loaders.stream import read_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8,
          torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES),
                          st.lists(st.integers(1, 5), min_size=0, max_size=3)),
                min_size=1, max_size=6))
def test_header_and_byte_ranges_match_safetensors(tmp_path_factory, specs):
    path = str(tmp_path_factory.mktemp("st") / "t.safetensors")
    tensors = {f"t{i}": (torch.randn(shape) * 50).to(dtype) for i, (dtype, shape) in
               enumerate(specs)}
    save_file(tensors, path)
    infos = read_header(path)
    with safe_open(path, "pt") as f:
        assert set(infos) == set(f.keys())
        for name, info in infos.items():
            expected = f.get_tensor(name)
            assert info.dtype == expected.dtype and info.shape == tuple(expected.shape)
            assert torch.equal(read_tensor(info), expected)


def _write(path, header: bytes, payload: bytes = b"") -> str:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + payload)
    return str(path)


def _good_file(tmp_path) -> str:
    path = str(tmp_path / "good.safetensors")
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(8)}, path)
    return path


def test_truncated_file_is_refused_naming_it(tmp_path):
    path = _good_file(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(CheckpointError, match="good.safetensors.*past the end"):
        read_header(path)


@pytest.mark.parametrize("size", [0, 5])
def test_file_shorter_than_the_length_prefix(tmp_path, size):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\0" * size)
    with pytest.raises(CheckpointError, match="short.safetensors.*truncated"):
        read_header(str(path))


def test_header_length_beyond_file(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match="huge.safetensors.*corrupt safetensors header"):
        read_header(str(path))


def test_header_not_json(tmp_path):
    path = _write(tmp_path / "garbage.safetensors", b"\xff\xfe not json at all")
    with pytest.raises(CheckpointError, match="garbage.safetensors.*not JSON"):
        read_header(path)


@pytest.mark.parametrize("name,entry,payload,problem", [
    ("offsets", {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}, 64,
     "'w'.*past the end"),
    ("shape", {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 16]}, 64,
     "'w'.*does not hold"),
    ("dtype", {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}, 8,
     "'w' has dtype 'Q4', which mox does not read"),
    ("entry", {"dtype": "F32", "shape": "four", "data_offsets": [0, 16]}, 16,
     "corrupt header entry"),
])
def test_bad_header_entries(tmp_path, name, entry, payload, problem):
    path = _write(tmp_path / f"{name}.safetensors", json.dumps({"w": entry}).encode(),
                  b"\0" * payload)
    with pytest.raises(CheckpointError, match=f"{name}.safetensors.*{problem}"):
        read_header(path)

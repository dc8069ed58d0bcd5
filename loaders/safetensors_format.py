"""The safetensors container, read by hand: 8-byte little-endian header length, a JSON header,
then raw tensor bytes. We parse the header ourselves because the expert pager needs each
tensor's byte range in the file, which the safetensors library does not expose."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from .errors import CheckpointError

HEADER_LENGTH_BYTES = 8
# The reference implementation refuses headers above 100 MB; a larger value means corruption.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live: `file` at absolute byte `offset`, `nbytes` long."""

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def read_header(path: str) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, validated against the file's size."""
    try:
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(HEADER_LENGTH_BYTES)
            if len(prefix) < HEADER_LENGTH_BYTES:
                raise CheckpointError(path, f"truncated safetensors file ({file_size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + header_len > file_size:
                raise CheckpointError(
                    path, f"corrupt safetensors header: length {header_len} in a "
                    f"{file_size}-byte file")
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(path, f"cannot read safetensors file: {e.strerror}") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"corrupt safetensors header: not JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(path, "corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    data_start = HEADER_LENGTH_BYTES + header_len
    return {name: _tensor_info(path, name, entry, data_start, file_size)
            for name, entry in header.items()}


def _tensor_info(path: str, name: str, entry: object, data_start: int,
                 file_size: int) -> TensorInfo:
    if isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and (
            entry["dtype"] not in DTYPES):
        raise CheckpointError(path, f"tensor {name!r} has dtype {entry['dtype']!r}, which mox "
                              f"does not read (it reads {', '.join(DTYPES)})")
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(v) for v in entry["data_offsets"])
    except (KeyError, TypeError, ValueError, OverflowError) as e:     # (1e400: infinity)
        raise CheckpointError(path, f"corrupt header entry for tensor {name!r}: {entry!r}") from e
    expected = math.prod(shape) * dtype.itemsize
    if begin < 0 or end - begin != expected:
        raise CheckpointError(
            path, f"tensor {name!r}: byte range [{begin}, {end}) does not hold "
            f"{DTYPE_NAMES[dtype]}{list(shape)} ({expected} bytes)")
    if data_start + end > file_size:
        raise CheckpointError(
            path, f"tensor {name!r} ends at byte {data_start + end}, past the end of the "
            f"{file_size}-byte file (truncated?)")
    return TensorInfo(name, path, data_start + begin, end - begin, dtype, shape)

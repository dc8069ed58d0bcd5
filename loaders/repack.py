"""Rewrite a checkpoint expert-major: each expert's gate, up and down weights become one
contiguous range starting on a 4 KiB boundary, so the pager reads an expert with one aligned
read (O_DIRECT without a bounce copy at its edges). Tensor names, dtypes and bytes are
unchanged, so the result is still a valid Hugging Face checkpoint that any safetensors
reader loads; only the order of tensors in the files changes.

Alignment holds when an expert's byte size is a multiple of 4 KiB (every published MoE's is);
safetensors forbids holes between tensors, so nothing is padded between them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable

from .checkpoint import INDEX_FILE, Checkpoint
from .errors import CheckpointError
from .layout import is_fused
from .safetensors_format import DTYPE_NAMES, HEADER_LENGTH_BYTES, TensorInfo
from .writer import SINGLE_FILE, copy_side_files, plan_shards, write_json_atomic

ALIGNMENT = 4096
COPY_CHUNK_BYTES = 64 << 20
LAYOUT_KEY, EXPERT_MAJOR = "mox_layout", "expert-major"
LAYOUT_METADATA = {"format": "pt", LAYOUT_KEY: EXPERT_MAJOR}
Progress = Callable[[int], None]      # called with the number of bytes just copied


def expert_major_units(ckpt: Checkpoint) -> list[list[str]]:
    """What must stay together, in file order: each expert as [gate, up, down] (each weight
    followed by its scales where quantized), layer by layer; then every other tensor of the
    checkpoint (extras too) on its own."""
    units = [[info.name for info in ckpt.experts[key].infos] for key in sorted(ckpt.experts)]
    placed = {name for unit in units for name in unit}
    return units + [[n] for n in ckpt.tensors if n not in placed]


def is_expert_major(ckpt: Checkpoint) -> bool:
    """Whether every shard carries the marker `repack_expert_major` writes in its header
    metadata. The marker, not the tensor order, decides: `save_pretrained` often stores an
    expert's three tensors side by side too, but unaligned and with no promise of it."""
    files = {info.file for info in ckpt.tensors.values()}
    return bool(files) and all(_metadata(f).get(LAYOUT_KEY) == EXPERT_MAJOR for f in files)


def _metadata(path: str) -> dict:
    """A shard's `__metadata__` (its header was validated when the checkpoint opened)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(HEADER_LENGTH_BYTES))
        metadata = json.loads(f.read(header_len)).get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def repack_expert_major(src: str, dst: str, max_shard_bytes: int = 4 << 30,
                        progress: Progress | None = None) -> str:
    """Write `src` expert-major into `dst`; `progress` hears of every chunk copied (the
    total is the sum of the tensors' bytes)."""
    ckpt = Checkpoint(src)
    if is_fused(ckpt.spec):
        raise CheckpointError(ckpt.path, "experts are stored fused ([E, ...] tensors, GPT-OSS): "
                              "each expert's parts are already contiguous ranges; serve the "
                              "checkpoint as it is")
    os.makedirs(dst, exist_ok=True)
    copy_side_files(ckpt.path, dst)
    units = expert_major_units(ckpt)
    # plan over whole units, so no expert straddles two shards
    unit_shards = plan_shards({str(i): sum(ckpt.tensors[n].nbytes for n in unit)
                               for i, unit in enumerate(units)}, max_shard_bytes)
    shards = [[n for i in group for n in units[int(i)]] for group in unit_shards]
    files = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for names, file in zip(shards, files):
        _write_shard(os.path.join(dst, file), [ckpt.tensors[n] for n in names], progress)
    if len(shards) > 1:
        write_json_atomic(os.path.join(dst, INDEX_FILE), {
            "metadata": {"total_size": sum(i.nbytes for i in ckpt.tensors.values())},
            "weight_map": {n: f for names, f in zip(shards, files) for n in names}})
    return dst


def _header(infos: list[TensorInfo]) -> bytes:
    header, pos = {"__metadata__": LAYOUT_METADATA}, 0
    for info in infos:
        header[info.name] = {"dtype": DTYPE_NAMES[info.dtype], "shape": list(info.shape),
                             "data_offsets": [pos, pos + info.nbytes]}
        pos += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    # pad with spaces (the format allows it) so the data starts on an aligned byte
    data_start = math.ceil((HEADER_LENGTH_BYTES + len(raw)) / ALIGNMENT) * ALIGNMENT
    return raw + b" " * (data_start - HEADER_LENGTH_BYTES - len(raw))


def _write_shard(path: str, infos: list[TensorInfo], progress: Progress | None) -> None:
    header = _header(infos)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as out:
        out.write(len(header).to_bytes(HEADER_LENGTH_BYTES, "little") + header)
        for info in infos:
            _copy_range(info, out, progress)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _copy_range(info: TensorInfo, out, progress: Progress | None) -> None:
    with open(info.file, "rb") as src:
        done = 0
        while done < info.nbytes:
            chunk = os.pread(src.fileno(), min(COPY_CHUNK_BYTES, info.nbytes - done),
                             info.offset + done)
            if not chunk:
                raise OSError(f"{info.file}: ends inside tensor {info.name!r}")
            out.write(chunk)
            done += len(chunk)
            if progress is not None:
                progress(len(chunk))

"""Write tensors as a sharded safetensors checkpoint, as `save_pretrained` does: shards named
`model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`, or a single
`model.safetensors` when everything fits in one shard.

Tensors are produced lazily by `make(name)`, one shard at a time, so a multi-GB checkpoint
is written with one shard's worth of memory.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable

import torch
from safetensors.torch import save_file

from .checkpoint import INDEX_FILE

SINGLE_FILE = "model.safetensors"
# Weights in formats mox does not read (PyTorch pickles, TF, Flax, GGUF, ONNX), which a whole
# Hugging Face snapshot may carry beside its safetensors; an import's copy leaves them out
# (Mixtral's `consolidated.*.pt` alone are ~93 GB).
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx",
                         ".pkl", ".npz")


def copy_side_files(src: str, dst: str) -> None:
    """The files of checkpoint `src` other than its weights and their indexes (config,
    tokenizer, generation config, chat template, licence) into `dst`."""
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith((".safetensors", ".index.json",
                                                       *OTHER_WEIGHT_SUFFIXES)):
            shutil.copy2(path, os.path.join(dst, name))


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in order: a shard closes when the next tensor would overflow it."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def write_sharded(out_dir: str, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                  make: Callable[[str], torch.Tensor], max_shard_bytes: int) -> list[str]:
    """Write every tensor in `shapes` (made by `make`, cast to `dtype`); returns shard paths."""
    os.makedirs(out_dir, exist_ok=True)
    sizes = {name: math.prod(shape) * dtype.itemsize for name, shape in shapes.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    files = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for names, file in zip(shards, files):
        tensors = {name: make(name).to(dtype).contiguous() for name in names}
        for name, tensor in tensors.items():
            assert tuple(tensor.shape) == shapes[name], (name, tensor.shape)
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {name: file for names, file in zip(shards, files)
                                for name in names}}
        write_json_atomic(os.path.join(out_dir, INDEX_FILE), index)
    return [os.path.join(out_dir, f) for f in files]


def write_json_atomic(path: str, obj: object) -> None:
    """Write to a temporary file and rename, so readers never see half a file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

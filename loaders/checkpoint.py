"""A Hugging Face checkpoint folder: config, shards, every tensor's byte range, and the expert
index (layer, expert) -> byte ranges that the expert pager streams from."""

from __future__ import annotations

import glob
import json
import math
import os

from .config import load_spec
from .errors import CheckpointError
from .experts import ExpertTensors, expert_index
from .layout import expected_tensors
from .quantized import StoredWeight, WeightFormat, stored_weight
from .safetensors_format import TensorInfo, read_header
from .spec import ModelSpec

INDEX_FILE = "model.safetensors.index.json"

class Checkpoint:
    """Read-only view of a checkpoint folder: its spec, every tensor's byte range, and the
    expert index. Reading is the streaming reader's job (`loaders.stream`)."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(self.path, "checkpoint folder does not exist")
        self.spec: ModelSpec = load_spec(self.path)
        self.tensors: dict[str, TensorInfo] = _index_tensors(self.path)
        self.stored: dict[str, StoredWeight] = self._check_layout()
        self.experts: dict[tuple[int, int], ExpertTensors] = expert_index(
            self.spec, self.stored.__getitem__, self.info)
        self.expert_format: WeightFormat | None = _expert_format(self)

    def _check_layout(self) -> dict[str, StoredWeight]:
        """Every tensor the spec implies is present with its shape (or, quantized, its data
        and scales in the shapes of its format): a mismatched file fails here, naming the
        file and tensor, not later inside a matmul."""
        stored = {}
        for name, shape in expected_tensors(self.spec).items():
            weight = stored_weight(self.spec.quant, name, shape, self.tensors.get)
            if weight is None:
                self.info(name)                       # raises: missing tensor
            if weight.scale is None and weight.data.shape != shape:
                raise CheckpointError(weight.data.file, f"tensor {name!r} has shape "
                                      f"{list(weight.data.shape)}, config.json implies "
                                      f"{list(shape)}")
            stored[name] = weight
        return stored

    def info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(self.path, f"missing tensor {name!r}")
        return info

    def has(self, name: str) -> bool:
        return name in self.tensors

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert as stored (every expert of a model has the same shape)."""
        return next(iter(self.experts.values())).nbytes if self.experts else 0

    def dense_numel(self) -> int:
        """Values of the dense weights as the model holds them (quantized ones dequantized
        on load: their logical shapes, not their stored bytes)."""
        expert_names = {info.name for t in self.experts.values() for info in t.infos}
        shapes = expected_tensors(self.spec)
        numel = sum(math.prod(shapes[name]) for name, weight in self.stored.items()
                    if weight.data.name not in expert_names)
        if self.spec.tie_word_embeddings and self.has("lm_head.weight"):
            numel += math.prod(self.tensors["lm_head.weight"].shape)
        return numel

    def dense_tensors(self) -> list[TensorInfo]:
        """Every non-expert tensor the model reads, in file order. Extra tensors (DeepSeek's
        and GLM's multi-token-prediction layers) stay on disk."""
        expert_names = {info.name for t in self.experts.values() for info in t.infos}
        infos = [info for weight in self.stored.values() for info in weight.infos
                 if info.name not in expert_names]
        if self.spec.tie_word_embeddings and self.has("lm_head.weight"):
            infos.append(self.tensors["lm_head.weight"])
        return sorted(infos, key=lambda i: (i.file, i.offset))


def _expert_format(ckpt: Checkpoint) -> WeightFormat | None:
    """The format every expert is stored in (None: plainly); mixed experts are refused."""
    first: dict[WeightFormat | None, ExpertTensors] = {}     # an expert of each format
    for tensors in ckpt.experts.values():
        first.setdefault(tensors.fmt, tensors)
    if len(first) > 1:
        (a_fmt, a), (b_fmt, b) = list(first.items())[:2]
        raise CheckpointError(a.infos[0].file, f"some experts are stored quantized and others "
                              f"not ({a.infos[0].name!r} {_stored_as(a_fmt)}, "
                              f"{b.infos[0].name!r} {_stored_as(b_fmt)}); mox pages a "
                              "model's experts in one format")
    return next(iter(first), None)


def _stored_as(fmt: WeightFormat | None) -> str:
    return "plainly" if fmt is None else f"as {fmt.describe()}"


def _index_tensors(path: str) -> dict[str, TensorInfo]:
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        weight_map = _read_weight_map(index_path)
        shards = sorted(set(weight_map.values()))
    else:
        weight_map = None
        shards = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
        if not shards:
            raise CheckpointError(path, "no *.safetensors files in the checkpoint folder")
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        shard_path = os.path.join(path, shard)
        if not os.path.isfile(shard_path):
            raise CheckpointError(shard_path, f"shard listed in {INDEX_FILE} is missing")
        tensors.update(read_header(shard_path))
    for name, shard in (weight_map or {}).items():
        if name not in tensors or os.path.basename(tensors[name].file) != shard:
            raise CheckpointError(os.path.join(path, shard),
                                  f"tensor {name!r} listed in {INDEX_FILE} is not in this shard")
    return tensors


def _read_weight_map(index_path: str) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(index_path, f"corrupt index file: {e}") from e
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str)
                                                   for shard in weight_map.values()):
        raise CheckpointError(index_path, "corrupt index file: weight_map is not an object "
                              "of tensor names to shard file names")
    return weight_map

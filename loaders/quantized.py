"""Quantized checkpoints as published: which format a checkpoint's `quantization_config` names,
and how a linear weight is stored under it.

- `quant_method: "fp8"` (DeepSeek-V3/R1, Qwen3 `-FP8`): `X.weight` float8_e4m3fn and
  `X.weight_scale_inv` float32 `[ceil(N / bn), ceil(K / bk)]` for `weight_block_size
  [bn, bk]`.
- `quant_method: "compressed-tensors"` (llm-compressor): `X.weight` int8 / float8 (formats
  `int-quantized`, `float-quantized`) or `X.weight_packed` int32 (`pack-quantized`, int4) with
  `X.weight_scale`; the scheme is the `config_groups`' weights entry (int8 or FP8 per channel,
  int4 per group, FP8 per block). Every group must name the same scheme.

A weight is quantized where its scale tensor exists: the modules a config leaves out (its
`ignore` list or `modules_to_not_convert`: routers, lm_head, shared-expert gates) are stored
plainly, so the tensors decide, and a quantized-looking weight without its scale is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from mox.kernels.quant import FP8, INT4, INT8, WeightFormat

from .errors import CheckpointError
from .safetensors_format import TensorInfo

FP8_METHOD, COMPRESSED_TENSORS = "fp8", "compressed-tensors"
QUANT_METHODS = (FP8_METHOD, COMPRESSED_TENSORS)
PACKED_FORMAT = "pack-quantized"
_CT_FORMATS = ("int-quantized", "float-quantized", PACKED_FORMAT)


@dataclass(frozen=True)
class QuantSpec:
    """How this checkpoint stores a quantized linear weight `X.weight`."""

    method: str
    fmt: WeightFormat
    data_suffix: str = "weight"             # "weight_packed" for packed int4
    scale_suffix: str = "weight_scale"      # "weight_scale_inv" for quant_method fp8


@dataclass(frozen=True)
class StoredWeight:
    """A linear weight `[N, K]` as stored: plainly (`scale` None), or quantized."""

    data: TensorInfo
    scale: TensorInfo | None = None
    fmt: WeightFormat | None = None

    @property
    def infos(self) -> tuple[TensorInfo, ...]:
        return (self.data,) if self.scale is None else (self.data, self.scale)


def parse_quantization(config: dict[str, Any], path: str) -> QuantSpec | None:
    """The `quantization_config` of a config.json, or None for a method handled elsewhere
    (MXFP4) or none at all."""
    q = config.get("quantization_config") or {}
    method = q.get("quant_method")
    if method == FP8_METHOD:
        block = q.get("weight_block_size")
        if q.get("fmt", "e4m3") != "e4m3" or not _is_block(block):
            raise CheckpointError(path, "quant_method 'fp8': mox reads e4m3 weights with a "
                                  "weight_block_size [rows, cols] of positive sizes; got fmt "
                                  f"{q.get('fmt')!r}, weight_block_size {block!r}")
        return QuantSpec(method, WeightFormat(FP8, *block), scale_suffix="weight_scale_inv")
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(q, path)
    return None


def _compressed_tensors(q: dict[str, Any], path: str) -> QuantSpec:
    fmt_name = q.get("format")
    if fmt_name not in _CT_FORMATS:
        raise CheckpointError(path, f"compressed-tensors format {fmt_name!r} is not supported; "
                              f"mox reads {_CT_FORMATS}")
    groups = q.get("config_groups") or {}
    schemes = {_weight_scheme(group.get("weights") or {}, name, path)
               for name, group in groups.items()}
    if len(schemes) != 1:
        raise CheckpointError(path, f"compressed-tensors config_groups name {len(schemes)} "
                              "weight schemes; mox reads checkpoints with exactly one")
    fmt = schemes.pop()
    if (fmt.kind == INT4) != (fmt_name == PACKED_FORMAT):
        raise CheckpointError(path, f"compressed-tensors format {fmt_name!r} does not store "
                              f"{fmt.describe()} weights")
    return QuantSpec(COMPRESSED_TENSORS, fmt,
                     data_suffix="weight_packed" if fmt.kind == INT4 else "weight")


def _weight_scheme(w: dict[str, Any], group: str, path: str) -> WeightFormat:
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    where = f"compressed-tensors group {group!r}"
    if not w.get("symmetric", True):
        raise CheckpointError(path, f"{where}: asymmetric weights (a zero point) are not "
                              "supported")
    # ("static" is compressed-tensors' alias of "weight": the groups stay in column order)
    if w.get("actorder") not in (None, False, "weight", "static"):
        raise CheckpointError(path, f"{where}: actorder {w['actorder']!r} (groups in "
                              "weight_g_idx order) is not supported")
    if (kind, bits, strategy) == ("int", 8, "channel"):
        return WeightFormat(INT8)
    if (kind, bits, strategy) == ("int", 4, "group") and _is_size(w.get("group_size")):
        return WeightFormat(INT4, 1, w["group_size"])
    if (kind, bits, strategy) == ("float", 8, "channel"):
        return WeightFormat(FP8)
    if (kind, bits, strategy) == ("float", 8, "block") and _is_block(w.get("block_structure")):
        return WeightFormat(FP8, *w["block_structure"])
    raise CheckpointError(path, f"{where}: weights of type {kind!r}, num_bits {bits!r}, "
                          f"strategy {strategy!r} are not supported; mox reads int8 per "
                          "channel, int4 per group (a positive group_size), fp8 per channel or "
                          "block (a block_structure of two positive sizes)")


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_block(value: object) -> bool:
    """A block shape `[rows, cols]` of positive sizes."""
    return isinstance(value, list) and len(value) == 2 and all(map(_is_size, value))


def stored_weight(quant: QuantSpec | None, name: str, shape: tuple[int, ...],
                  lookup: Callable[[str], TensorInfo | None]) -> StoredWeight | None:
    """How the weight `name` of logical `shape` is stored (None: not in the checkpoint).
    Raises a CheckpointError naming the file and tensor where data and scale disagree with
    the format."""
    plain = lookup(name)
    if quant is None or not name.endswith(".weight") or len(shape) != 2:
        return None if plain is None else _plain(plain)
    base = name[:-len("weight")]
    scale, data = lookup(base + quant.scale_suffix), lookup(base + quant.data_suffix)
    if scale is None:
        if data is not None and _holds_codes(data.dtype):
            raise CheckpointError(data.file, f"quantized tensor {data.name!r} has no scale "
                                  f"tensor {base + quant.scale_suffix!r}")
        return None if plain is None else _plain(plain)
    if data is None:
        raise CheckpointError(scale.file, f"scale {scale.name!r} has no weight tensor "
                              f"{base + quant.data_suffix!r}")
    fmt = quant.fmt
    data = _as_stored(data, fmt)
    rows, cols = shape
    expected = fmt.stored_shape(rows, cols)
    if data.shape != expected or data.dtype != fmt.storage_dtype:
        raise CheckpointError(data.file, f"quantized tensor {data.name!r} is {data.dtype}"
                              f"{list(data.shape)}; {fmt.describe()} of a [{rows}, {cols}] "
                              f"weight is {fmt.storage_dtype}{list(expected)}")
    if tuple(scale.shape) != fmt.scale_shape(rows, cols) or not scale.dtype.is_floating_point:
        raise CheckpointError(scale.file, f"scale tensor {scale.name!r} is {scale.dtype}"
                              f"{list(scale.shape)}; {fmt.describe()} of a [{rows}, {cols}] "
                              f"weight needs float{list(fmt.scale_shape(rows, cols))}")
    return StoredWeight(data, scale, fmt)


def _holds_codes(dtype: torch.dtype) -> bool:
    """Integers or 8-bit floats: quantized codes, which mean nothing without their scales."""
    return not dtype.is_floating_point or dtype.itemsize == 1


def _plain(info: TensorInfo) -> StoredWeight:
    """A weight stored as it is used: its values must be floats of 16 bits or more (int8 or
    FP8 codes read as values, their scales ignored, generated noise)."""
    if info.name.endswith(".weight") and _holds_codes(info.dtype):
        raise CheckpointError(info.file, f"tensor {info.name!r} is {info.dtype}: weights "
                              "stored quantized need config.json's quantization_config "
                              f"(quant_method one of {QUANT_METHODS}) and their scales")
    return StoredWeight(info)


def _as_stored(data: TensorInfo, fmt: WeightFormat) -> TensorInfo:
    """compressed-tensors packs int4 into int32 `[N, K / 8]`; its bytes are the uint8
    `[N, K / 2]` mox computes from (eight values an int32, little-endian, low nibble first)."""
    if fmt.kind == INT4 and data.dtype == torch.int32 and len(data.shape) == 2:
        return replace(data, dtype=torch.uint8, shape=(data.shape[0], data.shape[1] * 4))
    return data

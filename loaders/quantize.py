"""Quantize a bf16 checkpoint's experts into a published layout (`mox models import
--quantize`; tests write every layout mox reads this way):

- int8 per channel and int4 per group of 128 as compressed-tensors writes them
  (`int-quantized`: `X.weight` int8 + `X.weight_scale` `[N, 1]`; `pack-quantized`:
  `X.weight_packed` int32 `[N, K / 8]` + `X.weight_scale` `[N, K / 128]` + `X.weight_shape`);
- FP8 in blocks of 128 x 128 as DeepSeek-V3 (`X.weight` float8_e4m3fn +
  `X.weight_scale_inv`).

Experts only by default (`linears="experts"`); `linears="all"` quantizes every linear but the
embeddings, lm_head and routers, as DeepSeek's FP8 release does. Scales are float32. Tensors
are written in the source's order, each quantized weight followed by its scales, so a repack
keeps an expert's bytes one range.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

from mox.kernels.quant import FP8, INT4, WeightFormat, quantize

from .checkpoint import INDEX_FILE, Checkpoint
from .errors import CheckpointError
from .layout import expected_tensors, expert_tensors, is_fused, router_tensors
from .quantized import COMPRESSED_TENSORS, FP8_METHOD, PACKED_FORMAT
from .stream import read_tensor
from .writer import SINGLE_FILE, copy_side_files, write_json_atomic

EXPERTS, ALL_LINEARS = "experts", "all"
EXPERT_TARGET = r"re:.*\.experts\.\d+\..*"


def quantization_config(fmt: WeightFormat, linears: str) -> dict:
    """The `quantization_config` of a checkpoint written by `quantize_checkpoint`."""
    if fmt.kind == FP8 and fmt.block_rows > 1:
        return {"quant_method": FP8_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [fmt.block_rows, fmt.block_cols]}
    weights = {"num_bits": 4 if fmt.kind == INT4 else 8, "symmetric": True,
               "type": "float" if fmt.kind == FP8 else "int",
               "strategy": "group" if fmt.block_cols else "channel",
               "group_size": fmt.block_cols or None}
    return {"quant_method": COMPRESSED_TENSORS,
            "format": PACKED_FORMAT if fmt.kind == INT4 else
            "float-quantized" if fmt.kind == FP8 else "int-quantized",
            "config_groups": {"group_0": {
                "targets": [EXPERT_TARGET] if linears == EXPERTS else ["Linear"],
                "weights": weights, "input_activations": None}},
            "ignore": ["lm_head", r"re:.*mlp\.gate$"]}


def _to_quantize(ckpt: Checkpoint, linears: str) -> set[str]:
    spec = ckpt.spec
    moe = [layer for layer in range(spec.num_layers) if spec.moe_layers[layer]]
    experts = {name for layer in moe for expert in range(spec.num_experts)
               for name in expert_tensors(spec, layer, expert)}
    if linears == EXPERTS:
        return experts
    routers = {name for layer in moe for name in router_tensors(spec, layer)}
    return {name for name, shape in expected_tensors(spec).items()
            if len(shape) == 2 and name.endswith(".weight") and name not in routers
            and "embed_tokens" not in name and "shared_expert_gate" not in name}


def _stored(name: str, weight: torch.Tensor, fmt: WeightFormat
            ) -> Iterator[tuple[str, torch.Tensor]]:
    data, scale = quantize(weight, fmt)
    base = name[:-len("weight")]
    if fmt.kind == INT4:
        yield base + "weight_packed", data.view(torch.int32)
        yield base + "weight_scale", scale
        yield base + "weight_shape", torch.tensor(list(weight.shape), dtype=torch.int64)
    elif fmt.kind == FP8 and fmt.block_rows > 1:
        yield base + "weight", data
        yield base + "weight_scale_inv", scale
    else:
        yield base + "weight", data
        yield base + "weight_scale", scale


def quantize_checkpoint(src: str, dst: str, fmt: WeightFormat, linears: str = EXPERTS,
                        max_shard_bytes: int = 4 << 30) -> str:
    """Write `src` (a bf16 / fp32 checkpoint) into `dst` with its experts (or every linear)
    quantized in `fmt`; returns `dst`."""
    ckpt = Checkpoint(src)
    if ckpt.spec.quant is not None or is_fused(ckpt.spec):
        raise CheckpointError(ckpt.path, "mox quantizes separately stored bf16 / fp32 experts;"
                              " this checkpoint is already quantized or stores experts fused")
    if fmt.kind == INT4 and ckpt.spec.hidden_size % 8 + ckpt.spec.moe_intermediate_size % 8:
        raise CheckpointError(ckpt.path, "int4 packs eight values an int32: hidden and "
                              "intermediate sizes must be multiples of 8")
    chosen = _to_quantize(ckpt, linears)
    os.makedirs(dst, exist_ok=True)
    copy_side_files(ckpt.path, dst)
    with open(os.path.join(ckpt.path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(fmt, linears)
    write_json_atomic(os.path.join(dst, "config.json"), config)
    _write_shards(dst, _tensors(ckpt, chosen, fmt), max_shard_bytes)
    return dst


def _tensors(ckpt: Checkpoint, chosen: set[str], fmt: WeightFormat
             ) -> Iterator[tuple[str, torch.Tensor]]:
    for info in sorted(ckpt.tensors.values(), key=lambda i: (i.file, i.offset)):
        tensor = read_tensor(info)
        if info.name in chosen:
            if not bool(torch.isfinite(tensor).all()):   # its scale would be NaN, silently
                raise CheckpointError(info.file, f"tensor {info.name!r} holds NaN or infinite "
                                      "values: it cannot be quantized")
            yield from _stored(info.name, tensor, fmt)
        else:
            yield info.name, tensor


def _write_shards(dst: str, tensors: Iterator[tuple[str, torch.Tensor]],
                  max_shard_bytes: int) -> None:
    """Shards of about `max_shard_bytes` in order (one in memory at a time), named as
    `save_pretrained` names them."""
    shard: dict[str, torch.Tensor] = {}
    used = total = 0
    staged: list[tuple[str, list[str]]] = []
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and used + nbytes > max_shard_bytes:
            staged.append(_save(dst, len(staged), shard))
            shard, used = {}, 0
        shard[name] = tensor.contiguous()
        used += nbytes
        total += nbytes
    staged.append(_save(dst, len(staged), shard))
    if len(staged) == 1:
        os.replace(os.path.join(dst, staged[0][0]), os.path.join(dst, SINGLE_FILE))
        return
    files = {}
    for i, (tmp, names) in enumerate(staged):
        file = f"model-{i + 1:05d}-of-{len(staged):05d}.safetensors"
        os.replace(os.path.join(dst, tmp), os.path.join(dst, file))
        files.update(dict.fromkeys(names, file))
    write_json_atomic(os.path.join(dst, INDEX_FILE), {"metadata": {"total_size": total},
                                                      "weight_map": files})


def _save(dst: str, index: int, tensors: dict[str, torch.Tensor]) -> tuple[str, list[str]]:
    tmp = f"shard-{index}.safetensors.tmp"
    save_file(tensors, os.path.join(dst, tmp), metadata={"format": "pt"})
    return tmp, list(tensors)


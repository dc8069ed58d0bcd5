"""Checkpoint -> `MoEDecoder`: dense weights read whole, experts left to the pager."""

from __future__ import annotations

import torch

from mox.kernels import dequantize
from mox.loaders import Checkpoint, TensorInfo
from mox.loaders.spec import QK_NORM_NONE, ModelSpec
from mox.loaders.stream import ByteRange, StreamingReader
from mox.models.attention import AttentionWeights
from mox.models.decode_graphs import default_capture
from mox.models.decoder import LayerWeights, MoEDecoder
from mox.models.layers import MLPWeights
from mox.models.mla import MLAWeights
from mox.models.moe import MoEWeights
from mox.pager import ModelPool

# The dense weights are read in pieces of at most this many bytes, so a piece's copy out of
# the bounce buffer (and its fresh destination's page faults) overlaps the next piece's read
# on another I/O thread. Cold, 173 MB of dense weights (two 65 MB vocabulary matrices) took
# 0.205 s (median of 4) as four reads, 0.157 s in pieces of 4 MiB (8: 0.161, 2: 0.154, 1:
# 0.161; the bf16 copy 0.184 -> 0.165; alternated, AMD EPYC Zen 3 VM, O_DIRECT).
DENSE_READ_BYTES = 4 << 20


def prefetch_by_default(device: torch.device) -> bool:
    """Predictive prefetch pays where I/O and compute use different processors (a GPU). On a
    CPU the I/O threads take cores from the compute and wrong guesses cost disk reads: on the
    2-core dev machine it changed cold TTFT by -5%..+15% between runs (noise) while costing
    25-40% more CPU time and 5-15% more bytes read (bench/results/coldstart.md), so it is off
    there unless asked for."""
    return device.type == "cuda"


class _DenseReader:
    """Every dense tensor read at once on the reader's I/O threads (pieces of up to
    DENSE_READ_BYTES in file order, each one coalesced run where tensors are adjacent), then
    handed out by name, on the device and in the serving dtype. Shapes were checked when the
    checkpoint opened. Dense weights stored quantized (FP8 DeepSeek checkpoints quantize
    every linear) are dequantized here: only experts are computed quantized."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                 reader: StreamingReader) -> None:
        self.dtype, self.device, self._stored = dtype, device, ckpt.stored
        infos = ckpt.dense_tensors()
        pin = device.type == "cuda"
        self._host = {i.name: torch.empty(i.shape, dtype=i.dtype, pin_memory=pin)
                      for i in infos}
        futures = [reader.submit(ranges, outs)
                   for ranges, outs in _pieces(infos, self._host, DENSE_READ_BYTES)]
        for future in futures:
            future.result()

    def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor in the serving dtype, or in `dtype` (routers kept in fp32)."""
        weight = self._stored.get(name)
        if weight is not None and weight.scale is not None:
            value = dequantize(self._host[weight.data.name], self._host[weight.scale.name],
                               weight.fmt, dtype or self.dtype)
            return value.to(self.device)
        return self._host[name].to(device=self.device, dtype=dtype or self.dtype)


def _pieces(infos: list[TensorInfo], host: dict[str, torch.Tensor], most: int
            ) -> list[tuple[list[ByteRange], list[torch.Tensor]]]:
    """The tensors' bytes as reads of at most `most` bytes each (in order; a large tensor
    split, small ones together): each read's ranges and the flat byte views they fill."""
    pieces: list[tuple[list[ByteRange], list[torch.Tensor]]] = []
    size = 0                                    # bytes in the last piece
    for info in infos:
        flat = host[info.name].view(-1).view(torch.uint8)
        for start in range(0, info.nbytes, most):
            length = min(most, info.nbytes - start)
            if not pieces or size + length > most:
                pieces.append(([], []))
                size = 0
            pieces[-1][0].append(ByteRange(info.file, info.offset + start, length, info.name))
            pieces[-1][1].append(flat[start:start + length])
            size += length
    return pieces


def load_model(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
               experts: ModelPool) -> MoEDecoder:
    """The dense weights, read now; the experts stay with the pager (`experts`, the model's
    pool, whose reader reads the dense weights too)."""
    spec = ckpt.spec
    read = _DenseReader(ckpt, dtype, device, experts.loader.reader)
    embed = read("model.embed_tokens.weight")
    if spec.tie_word_embeddings and not ckpt.has("lm_head.weight"):
        lm_head = embed
    else:
        lm_head = read("lm_head.weight")
    layers = []
    moe_layer = 0
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}"
        if spec.moe_layers[i]:
            mlp = _moe_weights(spec, read, i, moe_layer)
            moe_layer += 1
        else:
            mlp = _mlp_weights(read, f"{prefix}.mlp")
        layers.append(LayerWeights(
            input_norm=read(f"{prefix}.input_layernorm.weight"),
            post_attention_norm=read(f"{prefix}.post_attention_layernorm.weight"),
            attention=_attention_weights(spec, read, f"{prefix}.self_attn"),
            mlp=mlp))
    final_norm = read("model.norm.weight")
    model = MoEDecoder(spec, embed, layers, final_norm, lm_head, experts)
    model.use_graphs(default_capture(model.device))     # (GPUs: decode steps as CUDA graphs)
    return model


def _attention_weights(spec: ModelSpec, read: _DenseReader,
                       prefix: str) -> AttentionWeights | MLAWeights:
    if spec.mla is not None:
        return _mla_weights(spec, read, prefix)
    projections = [f"{prefix}.{name}_proj" for name in "qkv"]
    w = AttentionWeights(qkv=torch.cat([read(f"{p}.weight") for p in projections]),
                         o=read(f"{prefix}.o_proj.weight"))
    if spec.qkv_bias:
        w.qkv_bias = torch.cat([read(f"{p}.bias") for p in projections])
    if spec.o_bias:
        w.o_bias = read(f"{prefix}.o_proj.bias")
    if spec.qk_norm != QK_NORM_NONE:
        w.q_norm = read(f"{prefix}.q_norm.weight")
        w.k_norm = read(f"{prefix}.k_norm.weight")
    if spec.attention_sinks:
        w.sinks = read(f"{prefix}.sinks")
    return w


def _mla_weights(spec: ModelSpec, read: _DenseReader, prefix: str) -> MLAWeights:
    w = MLAWeights(kv_a=read(f"{prefix}.kv_a_proj_with_mqa.weight"),
                   kv_a_norm=read(f"{prefix}.kv_a_layernorm.weight"),
                   kv_b=read(f"{prefix}.kv_b_proj.weight"), o=read(f"{prefix}.o_proj.weight"))
    if spec.mla.q_lora_rank is None:
        w.q = read(f"{prefix}.q_proj.weight")
    else:
        w.q_a = read(f"{prefix}.q_a_proj.weight")
        w.q_a_norm = read(f"{prefix}.q_a_layernorm.weight")
        w.q_b = read(f"{prefix}.q_b_proj.weight")
    if spec.qkv_bias:
        w.kv_a_bias = read(f"{prefix}.kv_a_proj_with_mqa.bias")
        if spec.mla.q_lora_rank is not None:
            w.q_a_bias = read(f"{prefix}.q_a_proj.bias")
    if spec.o_bias:
        w.o_bias = read(f"{prefix}.o_proj.bias")
    return w


def _mlp_weights(read: _DenseReader, prefix: str) -> MLPWeights:
    return MLPWeights(gate=read(f"{prefix}.gate_proj.weight"),
                      up=read(f"{prefix}.up_proj.weight"),
                      down=read(f"{prefix}.down_proj.weight"))


def _moe_weights(spec: ModelSpec, read: _DenseReader, layer: int, moe_layer: int) -> MoEWeights:
    router_dtype = torch.float32 if spec.router.fp32 else None
    prefix = spec.naming.router_prefix(layer)
    w = MoEWeights(router=read(f"{prefix}.weight", router_dtype), moe_layer=moe_layer)
    if spec.router.bias:
        w.router_bias = read(f"{prefix}.bias", router_dtype)
    if spec.router.correction_bias:
        w.correction_bias = read(f"{prefix}.e_score_correction_bias", torch.float32)
    if spec.has_shared_expert:
        w.shared_expert = _mlp_weights(read, spec.naming.shared_expert_prefix(layer))
        if spec.shared_expert_gated:
            w.shared_expert_gate = read(f"model.layers.{layer}.mlp.shared_expert_gate.weight")
    return w

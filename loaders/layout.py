"""The Hugging Face tensor layout of a `ModelSpec`: every tensor name a published checkpoint
of that architecture has, with its shape. The loader validates checkpoints against it and the
demo builder writes it, so both agree with the real thing by construction."""

from __future__ import annotations

from .spec import EXPERTS_FUSED, EXPERTS_MXFP4, QK_NORM_FULL, QK_NORM_PER_HEAD, ModelSpec

Shape = tuple[int, ...]
# MXFP4 (OCP microscaling): blocks of 32 FP4 values sharing one 8-bit power-of-two scale;
# two values a byte, so a block is 16 bytes.
MXFP4_BLOCK_VALUES, MXFP4_BLOCK_BYTES = 32, 16


def expected_tensors(spec: ModelSpec) -> dict[str, Shape]:
    hidden = spec.hidden_size
    shapes: dict[str, Shape] = {"model.embed_tokens.weight": (spec.vocab_size, hidden)}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes.update(_attention(spec, f"{prefix}.self_attn"))
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        if spec.moe_layers[layer]:
            shapes.update(_moe(spec, layer))
        else:
            shapes.update(mlp_tensors(f"{prefix}.mlp", hidden, spec.dense_intermediate_size))
    shapes["model.norm.weight"] = (hidden,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, hidden)
    return shapes


def expert_tensors(spec: ModelSpec, layer: int, expert: int) -> dict[str, Shape]:
    """Gate, up, down of one expert, in that order (checkpoints storing experts separately)."""
    assert not is_fused(spec), spec.expert_storage
    naming, hidden, inter = spec.naming, spec.hidden_size, spec.moe_intermediate_size
    prefix = naming.expert_prefix(layer, expert)
    return {f"{prefix}.{naming.gate}.weight": (inter, hidden),
            f"{prefix}.{naming.up}.weight": (inter, hidden),
            f"{prefix}.{naming.down}.weight": (hidden, inter)}


def is_fused(spec: ModelSpec) -> bool:
    return spec.expert_storage in (EXPERTS_FUSED, EXPERTS_MXFP4)


def fused_expert_tensors(spec: ModelSpec, layer: int) -> dict[str, Shape]:
    """GPT-OSS's `[E, ...]` tensors of one layer. bf16: gate_up `[E, H, 2I]` (gate and up
    columns interleaved), down `[E, I, H]`, biases. MXFP4: the weights as `*_blocks`
    `[E, rows, cols / 32, 16]` and `*_scales` `[E, rows, cols / 32]` in output-row order
    (gate_up rows interleaved), biases as in bf16. Expert e is index e of each."""
    prefix, hidden = spec.naming.fused_experts(layer), spec.hidden_size
    experts, inter = spec.num_experts, spec.moe_intermediate_size
    shapes = {f"{prefix}.gate_up_proj_bias": (experts, 2 * inter),
              f"{prefix}.down_proj_bias": (experts, hidden)}
    if spec.expert_storage == EXPERTS_FUSED:
        return {f"{prefix}.gate_up_proj": (experts, hidden, 2 * inter),
                f"{prefix}.down_proj": (experts, inter, hidden), **shapes}
    for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        blocks = cols // MXFP4_BLOCK_VALUES
        shapes[f"{prefix}.{name}_blocks"] = (experts, rows, blocks, MXFP4_BLOCK_BYTES)
        shapes[f"{prefix}.{name}_scales"] = (experts, rows, blocks)
    return shapes


def mlp_tensors(prefix: str, hidden: int, inter: int) -> dict[str, Shape]:
    return {f"{prefix}.gate_proj.weight": (inter, hidden),
            f"{prefix}.up_proj.weight": (inter, hidden),
            f"{prefix}.down_proj.weight": (hidden, inter)}


def _attention(spec: ModelSpec, prefix: str) -> dict[str, Shape]:
    if spec.mla is not None:
        return _mla_attention(spec, prefix)
    hidden, q_width = spec.hidden_size, spec.num_heads * spec.head_dim
    kv_width = spec.num_kv_heads * spec.head_dim
    shapes: dict[str, Shape] = {f"{prefix}.q_proj.weight": (q_width, hidden),
                                f"{prefix}.k_proj.weight": (kv_width, hidden),
                                f"{prefix}.v_proj.weight": (kv_width, hidden),
                                f"{prefix}.o_proj.weight": (hidden, q_width)}
    if spec.qkv_bias:
        shapes.update({f"{prefix}.q_proj.bias": (q_width,), f"{prefix}.k_proj.bias": (kv_width,),
                       f"{prefix}.v_proj.bias": (kv_width,)})
    if spec.o_bias:
        shapes[f"{prefix}.o_proj.bias"] = (hidden,)
    if spec.qk_norm == QK_NORM_PER_HEAD:
        shapes.update({f"{prefix}.q_norm.weight": (spec.head_dim,),
                       f"{prefix}.k_norm.weight": (spec.head_dim,)})
    elif spec.qk_norm == QK_NORM_FULL:
        shapes.update({f"{prefix}.q_norm.weight": (q_width,),
                       f"{prefix}.k_norm.weight": (kv_width,)})
    if spec.attention_sinks:
        shapes[f"{prefix}.sinks"] = (spec.num_heads,)
    return shapes


def _mla_attention(spec: ModelSpec, prefix: str) -> dict[str, Shape]:
    mla, hidden, heads = spec.mla, spec.hidden_size, spec.num_heads
    shapes: dict[str, Shape] = {}
    if mla.q_lora_rank is None:
        shapes[f"{prefix}.q_proj.weight"] = (heads * mla.qk_head_dim, hidden)
    else:
        shapes.update({f"{prefix}.q_a_proj.weight": (mla.q_lora_rank, hidden),
                       f"{prefix}.q_a_layernorm.weight": (mla.q_lora_rank,),
                       f"{prefix}.q_b_proj.weight": (heads * mla.qk_head_dim, mla.q_lora_rank)})
        if spec.qkv_bias:
            shapes[f"{prefix}.q_a_proj.bias"] = (mla.q_lora_rank,)
    kv_a = mla.kv_lora_rank + mla.qk_rope_head_dim
    shapes.update({
        f"{prefix}.kv_a_proj_with_mqa.weight": (kv_a, hidden),
        f"{prefix}.kv_a_layernorm.weight": (mla.kv_lora_rank,),
        f"{prefix}.kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                       mla.kv_lora_rank),
        f"{prefix}.o_proj.weight": (hidden, heads * mla.v_head_dim)})
    if spec.qkv_bias:
        shapes[f"{prefix}.kv_a_proj_with_mqa.bias"] = (kv_a,)
    if spec.o_bias:
        shapes[f"{prefix}.o_proj.bias"] = (hidden,)
    return shapes


def _moe(spec: ModelSpec, layer: int) -> dict[str, Shape]:
    shapes = router_tensors(spec, layer)
    if is_fused(spec):
        shapes.update(fused_expert_tensors(spec, layer))
    else:
        for expert in range(spec.num_experts):
            shapes.update(expert_tensors(spec, layer, expert))
    if spec.has_shared_expert:
        shapes.update(mlp_tensors(spec.naming.shared_expert_prefix(layer), spec.hidden_size,
                                  spec.shared_expert_intermediate_size))
        if spec.shared_expert_gated:
            shapes[f"model.layers.{layer}.mlp.shared_expert_gate.weight"] = (1, spec.hidden_size)
    return shapes


def router_tensors(spec: ModelSpec, layer: int) -> dict[str, Shape]:
    prefix = spec.naming.router_prefix(layer)
    shapes: dict[str, Shape] = {f"{prefix}.weight": (spec.num_experts, spec.hidden_size)}
    if spec.router.correction_bias:
        shapes[f"{prefix}.e_score_correction_bias"] = (spec.num_experts,)
    if spec.router.bias:
        shapes[f"{prefix}.bias"] = (spec.num_experts,)
    return shapes

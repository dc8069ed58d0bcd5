"""Shared fixtures: tiny real checkpoints written by transformers' `save_pretrained`."""

from __future__ import annotations

import os
import signal

import torch

# Without a GPU, Triton kernels run only under the interpreter, which must be chosen before
# any kernel is decorated, i.e. before mox.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, num_experts_per_tok=2,
            max_position_embeddings=256,
            # a wide init so logits are of order 1, which makes the 1e-4 parity bound meaningful
            initializer_range=0.2)

# name -> (model_type, config overrides). Each case turns on a feature of the decoder.
CASES = {
    "mixtral": ("mixtral", dict(num_local_experts=4)),
    "mixtral-sliding": ("mixtral", dict(num_local_experts=4, sliding_window=6)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=6, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=48, num_hidden_layers=3,
                                    decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, moe_intermediate_size=16, head_dim=16,
                                    norm_topk_prob=True, tie_word_embeddings=True)),
    "olmoe": ("olmoe", dict(num_experts=8, clip_qkv=3.0, norm_topk_prob=False)),
    # sigmoid grouped routing with a correction bias, a dense first layer, shared experts,
    # partial rotary, per-head q/k norm
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=8, moe_intermediate_size=16, n_group=2,
                                  topk_group=1, first_k_dense_replace=1, num_hidden_layers=3,
                                  head_dim=16, use_qk_norm=True, attention_bias=True,
                                  routed_scaling_factor=2.5, partial_rotary_factor=0.5)),
    # MLA with q LoRA and biases, interleaved YaRN rope (mscale), sigmoid grouped routing
    "deepseek_v3": ("deepseek_v3", dict(
        n_routed_experts=8, moe_intermediate_size=16, n_group=2, topk_group=1,
        first_k_dense_replace=1, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        attention_bias=True, routed_scaling_factor=2.5, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
            original_max_position_embeddings=64))),
    # MLA without q LoRA (V2-Lite), complex-pair rope, group-limited softmax routing
    "deepseek_v2": ("deepseek_v2", dict(
        n_routed_experts=8, moe_intermediate_size=16, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, norm_topk_prob=False,
        first_k_dense_replace=1, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)),
    # fused experts with biases, clamped SwiGLU (a low limit so it clamps), biased router,
    # attention sinks, sliding and full layers, YaRN (its default rope)
    "gpt_oss": ("gpt_oss", dict(num_local_experts=8, intermediate_size=32, head_dim=16,
                                sliding_window=6, swiglu_limit=1.0, rope_parameters=dict(
                                    rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                    original_max_position_embeddings=64, truncate=False))),
}
# Tensors transformers initializes to constants (zeros): random in the tests, so they count.
RANDOMIZED_SUFFIXES = ("e_score_correction_bias", "gate_up_proj_bias", "down_proj_bias")
RANDOMIZED_SCALE = 0.1


def make_hf_checkpoint(path: str, case: str, max_shard_size: str | None = None,
                       seed: int = 0, **config: object):
    """Save a random-weight transformers model of `case` to `path` (`config`: more
    overrides); returns the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = CASES[case]
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides, **config})
    config.eos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(RANDOMIZED_SUFFIXES):
                tensor.copy_(RANDOMIZED_SCALE * torch.randn(tensor.shape))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


def open_tiny(path: str, dtype: torch.dtype = torch.float32):
    """A loaded mox decoder on CPU, every expert resident: built as `LLM` builds it (a router
    of its own), which keeps the pager and loader threads it reads through alive."""
    from mox import LLM

    return LLM(path, dtype=dtype, kv_memory=1 << 20).model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """case -> (checkpoint folder, transformers model); built once per session."""
    root = tmp_path_factory.mktemp("hf")
    built = {}
    for case in CASES:
        path = os.path.join(root, case)
        built[case] = (path, make_hf_checkpoint(path, case))
    return built


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory):
    from mox.demo import ensure_demo_models

    home = str(tmp_path_factory.mktemp("mox_home"))
    ensure_demo_models(home)
    return home


def serve_loaded(engine, name: str, model, tokenizer=None, eos_token_ids=()) -> None:
    """Register an already loaded model with an engine and hand it its weights."""
    engine.add_model(name, model.spec, model.dtype, model.device, tokenizer, eos_token_ids)
    engine.set_weights(name, model)


def tiny_router(path: str, name: str = "olmoe", whole: bool | None = None, **config):
    """A router serving one tiny checkpoint in fp32, warmed up (`whole`: with every expert
    read; None: as the policy loads)."""
    from mox.router import Router, RouterConfig

    config = {"dtype": "float32", "kv_memory": 64 << 20, **config}
    router = Router({name: path}, RouterConfig(**config))
    router.warm_up(name, whole)
    return router


def byte_fallback_tokenizer(folder) -> str:
    """A SentencePiece-style tokenizer.json in `folder` (Mistral's pipeline: "<0xNN>" pieces
    for single bytes, U+2581 for a space, the first space stripped): 256 byte pieces after
    <unk>, then "\u2581h" (257), "i" (258) and the special "</s>" (259). Returns its path."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581h": 257,
             "i": 258}
    hf = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["</s>"])
    path = os.path.join(folder, "tokenizer.json")
    hf.save(path)
    return path



def default_sigint() -> None:
    """A `Popen(preexec_fn=...)` for a child the test stops with SIGINT: it takes Ctrl-C as
    under a terminal even when the test run itself was started in the background, where
    the shell starts it with SIGINT ignored (and the child would inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

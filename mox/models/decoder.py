"""One generic MoE decoder for every supported architecture, driven by `ModelSpec`.

Legend: T tokens, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mox.loaders.spec import ModelSpec
from mox.models.attention import AttentionWeights, attention
from mox.models.experts import ModelExperts
from mox.models.kv_cache import SequenceKVCache
from mox.models.layers import MLPWeights, Rotary, rms_norm
from mox.models.moe import MoEWeights, moe_block, route


@dataclass
class LayerWeights:
    input_norm: torch.Tensor                  # [H]
    post_attention_norm: torch.Tensor         # [H]
    attention: AttentionWeights
    mlp: MoEWeights | MLPWeights              # MoE block, or a dense MLP layer


class MoEDecoder:
    def __init__(self, spec: ModelSpec, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor,
                 experts: ModelExperts) -> None:
        assert len(layers) == spec.num_layers
        self.spec = spec
        self.embed = embed                    # [V, H]
        self.layers = layers
        self.final_norm = final_norm          # [H]
        self.lm_head = lm_head                # [V, H] (the embedding itself when tied)
        self.experts = experts
        self.rotary = Rotary(spec.head_dim, spec.rope_theta, embed.device)
        moe = [layer.mlp for layer in layers if isinstance(layer.mlp, MoEWeights)]
        # each MoE block's successor, whose router predicts what to prefetch
        self.next_moe = {a.moe_layer: b for a, b in zip(moe, moe[1:])}

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_cache(self) -> SequenceKVCache:
        spec = self.spec
        return SequenceKVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.dtype,
                               self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: SequenceKVCache) -> torch.Tensor:
        """Run `input_ids` `[T]`, which follow the cache's tokens; returns logits `[T, V]` f32."""
        assert input_ids.dim() == 1 and input_ids.numel() > 0
        start = cache.num_tokens
        positions = torch.arange(start, start + input_ids.numel(), device=self.device)  # [T]
        x = F.embedding(input_ids.to(self.device), self.embed)                        # [T, H]
        eps = self.spec.rms_norm_eps
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, eps)
            x = x + attention(self.spec, layer.attention, i, h, positions, self.rotary, cache)
            h = rms_norm(x, layer.post_attention_norm, eps)
            if isinstance(layer.mlp, MoEWeights):
                self._prefetch_next(layer.mlp, h)
                x = x + moe_block(self.spec, layer.mlp, self.experts, h)
            else:
                x = x + layer.mlp(h)
        cache.num_tokens = start + input_ids.numel()
        x = rms_norm(x, self.final_norm, eps)
        return F.linear(x, self.lm_head).float()                                      # [T, V]

    def _prefetch_next(self, current: MoEWeights, h: torch.Tensor) -> None:
        """The next MoE layer's router applied to this layer's input predicts its experts
        (the residual stream changes little between layers): load them while this layer
        computes."""
        following = self.next_moe.get(current.moe_layer)
        if following is not None and self.experts.prefetch_enabled:
            _, ids = route(self.spec, following.router, h)
            self.experts.prefetch(following.moe_layer, ids.unique().tolist(),
                                  current_layer=current.moe_layer)

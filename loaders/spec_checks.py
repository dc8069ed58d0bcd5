"""Values a config.json parser took as they are but no model can run with: each a
CheckpointError naming the field, at load, rather than an assertion on the first request."""

from __future__ import annotations

from mox.kernels.routing import EXPERTS_PER_GROUP_SCORE

from .errors import CheckpointError
from .spec import ROUTING_SIGMOID_GROUPED, ROUTING_SOFTMAX_GROUPED, ModelSpec


def check_spec(spec: ModelSpec, path: str) -> None:
    """Values the parsers took as they are but no model can run with."""
    for field, value in (("num_hidden_layers", spec.num_layers),
                         ("num_experts_per_tok", spec.top_k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointError(path, f"{field} must be an integer, not {value!r}")
    if spec.num_layers < 1:
        raise CheckpointError(path, f"num_hidden_layers must be at least 1, not {spec.num_layers}")
    if not 1 <= spec.top_k <= spec.num_experts:
        raise CheckpointError(path, f"num_experts_per_tok must be between 1 and the "
                              f"{spec.num_experts} experts, not {spec.top_k}")
    if not any(spec.moe_layers):
        raise CheckpointError(path, "no layer is a mixture of experts (decoder_sparse_step, "
                              "mlp_only_layers, first_k_dense_replace or moe_layer_freq leave "
                              "every layer dense); mox serves MoE models")
    _check_groups(spec, path)


def _check_groups(spec: ModelSpec, path: str) -> None:
    """Grouped routing (DeepSeek, GLM4-MoE): the groups must split the experts and hold the
    experts a token takes."""
    router = spec.router
    if router.scoring not in (ROUTING_SIGMOID_GROUPED, ROUTING_SOFTMAX_GROUPED):
        return
    groups, kept = router.n_group, router.topk_group
    if spec.num_experts % groups:
        raise CheckpointError(path, f"n_group {groups} does not divide the "
                              f"{spec.num_experts} routed experts")
    size = spec.num_experts // groups
    if not 1 <= kept <= groups:
        raise CheckpointError(path, f"topk_group must be between 1 and n_group {groups}, "
                              f"not {kept}")
    if spec.top_k > kept * size:
        raise CheckpointError(path, f"num_experts_per_tok {spec.top_k} is more than the "
                              f"{kept * size} experts of topk_group {kept} groups of {size}")
    if router.scoring == ROUTING_SIGMOID_GROUPED and size < EXPERTS_PER_GROUP_SCORE:
        raise CheckpointError(path, f"n_group {groups} leaves groups of {size} expert; "
                              f"sigmoid routing scores each group by its best "
                              f"{EXPERTS_PER_GROUP_SCORE}")

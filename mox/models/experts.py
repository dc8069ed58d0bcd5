"""What a model's MoE blocks see of the expert pager: its own pool, by layer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mox.kernels import MoEWorkspace
from mox.pager import ExpertPager, Lease


@dataclass(frozen=True)
class ModelExperts:
    pager: ExpertPager
    model: str
    prefetch_enabled: bool = True

    def waves(self, moe_layer: int, expert_ids: Iterable[int]) -> Iterator[Lease]:
        return self.pager.waves(self.model, moe_layer, expert_ids)

    def prefetch(self, moe_layer: int, expert_ids: Iterable[int], current_layer: int) -> None:
        if self.prefetch_enabled:
            self.pager.prefetch(self.model, moe_layer, expert_ids,
                                protect_layers=(current_layer,))

    @property
    def workspace(self) -> MoEWorkspace:
        return self.pager.workspace(self.model)

    def check_integrity(self) -> None:
        self.pager.check_integrity(self.model)

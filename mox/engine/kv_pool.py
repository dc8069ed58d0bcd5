"""One elastic KV pool for every model: one byte budget; each model's sequences take
fixed-size blocks from their model's KV store, and a model with no live blocks holds no KV
memory at all (its store is released).

Block ids are per model (they index that model's store); the budget counts blocks in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mox.models.kv_store import KVStore


@dataclass
class _ModelBlocks:
    store: KVStore
    free: list[int] = field(default_factory=list)   # ids below the store's size, unused
    num_used: int = 0


class KVPool:
    def __init__(self, budget_bytes: int, block_size: int) -> None:
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self._models: dict[str, _ModelBlocks] = {}

    def add_model(self, name: str, store: KVStore) -> None:
        assert store.block_size == self.block_size
        self._models[name] = _ModelBlocks(store)

    def remove_model(self, name: str) -> None:
        assert self._models[name].num_used == 0, name
        self._models.pop(name).store.release()

    @property
    def used_bytes(self) -> int:
        return sum(m.num_used * m.store.block_nbytes for m in self._models.values())

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, model: str, num_blocks: int) -> bool:
        block = self._models[model].store.block_nbytes
        return self.used_bytes + num_blocks * block <= self.budget_bytes

    def allocate(self, model: str, num_blocks: int) -> list[int] | None:
        """`num_blocks` block ids for `model`, or None when the budget cannot take them."""
        if not self.can_allocate(model, num_blocks):
            return None
        m = self._models[model]
        while len(m.free) < num_blocks:                  # grow the model's store
            start = m.store.num_blocks
            m.store.ensure_blocks(start + num_blocks - len(m.free),
                                  max_blocks=self.budget_bytes // m.store.block_nbytes)
            m.free.extend(range(start, m.store.num_blocks))
        blocks, m.free = m.free[:num_blocks], m.free[num_blocks:]
        m.num_used += num_blocks
        return blocks

    def free(self, model: str, blocks: list[int]) -> None:
        m = self._models[model]
        m.free.extend(blocks)
        m.num_used -= len(blocks)
        if m.num_used == 0:                              # no live sequence: give it all back
            m.store.release()
            m.free = []

    def check_integrity(self) -> None:
        for name, m in self._models.items():
            assert m.num_used >= 0 and len(set(m.free)) == len(m.free), name
            assert len(m.free) + m.num_used == m.store.num_blocks, name
            assert all(0 <= b < m.store.num_blocks for b in m.free), name
        assert self.used_bytes <= self.budget_bytes

"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, one block table per sequence.

Token position p of a sequence lives in slot `table[p // block_size] * block_size + p % block_size`
of the cache arrays the model runner owns. Blocks are reference counted so a block could be shared;
today every block has exactly one owner, and `check_invariants` proves the accounting adds up.
"""
from __future__ import annotations

from collections import deque


class BlockTable:
    """The block ids holding one sequence's KV, in position order."""

    def __init__(self, owner: str):
        self.owner = owner
        self.block_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return f"BlockTable({self.owner!r}, {self.block_ids})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.tables: dict[str, BlockTable] = {}  # owner -> table holding blocks, for check_invariants

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, table: BlockTable, num_tokens: int) -> int:
        """How many blocks `table` must gain to hold `num_tokens` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(table))

    def can_allocate(self, table: BlockTable, num_tokens: int) -> bool:
        return self.num_new_blocks(table, num_tokens) <= len(self.free_block_ids)

    def allocate(self, table: BlockTable, num_tokens: int) -> None:
        """Grow `table` so it holds `num_tokens` tokens in total."""
        needed = self.num_new_blocks(table, num_tokens)
        if needed > len(self.free_block_ids):
            raise RuntimeError(f"{table.owner}: needs {needed} KV blocks, only {len(self.free_block_ids)} free")
        self.tables[table.owner] = table
        for _ in range(needed):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] += 1
            table.block_ids.append(block_id)

    def free(self, table: BlockTable) -> None:
        for block_id in reversed(table.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        table.block_ids.clear()
        self.tables.pop(table.owner, None)

    def slot_mapping(self, table: BlockTable, start: int, end: int) -> list[int]:
        """Cache slots of positions start..end-1."""
        size, blocks = self.block_size, table.block_ids
        return [blocks[p // size] * size + p % size for p in range(start, end)]

    def check_invariants(self, finished_tables: list[BlockTable] = ()) -> None:
        """Raise AssertionError unless: free + used == total; each block's refcount equals the number
        of tables holding it; free blocks have refcount 0 and appear once; `finished_tables` are empty.
        Run after every step of every property, so whole lists are compared first and searched only
        for the message."""
        free = self.free_block_ids
        if len(free) != len(set(free)):
            raise AssertionError(f"a block is on the free list twice: {sorted(free)}")
        owners = [0] * self.num_blocks
        for table in self.tables.values():
            for block_id in table.block_ids:
                owners[block_id] += 1
        if owners != self.ref_counts:
            block_id = next(b for b, (held, count) in enumerate(zip(owners, self.ref_counts)) if held != count)
            raise AssertionError(f"block {block_id}: refcount {self.ref_counts[block_id]} but held by "
                                 f"{owners[block_id]} tables")
        if any(self.ref_counts[b] for b in free):
            raise AssertionError(f"blocks both free and used: {sorted(b for b in set(free) if self.ref_counts[b])}")
        used = self.num_blocks - self.ref_counts.count(0)
        if len(free) + used != self.num_blocks:
            raise AssertionError(f"free {len(free)} + used {used} != total {self.num_blocks}")
        for table in finished_tables:
            if table.block_ids:
                raise AssertionError(f"{table.owner}: finished but still holds blocks {table.block_ids}")
            if table.owner in self.tables:
                raise AssertionError(f"{table.owner}: finished but still registered")

"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, one block table per sequence.

Token position p of a sequence lives in slot `table[p // block_size] * block_size + p % block_size`
of the cache arrays the model runner owns. Blocks are reference counted: a block's count is the
number of tables holding it, and `check_invariants` proves the accounting adds up.

With prefix caching (vLLM's automatic prefix caching), a FULL block whose KV has been computed is
registered under a hash chained through its parent block's hash and its own token ids
(block_hashes), so equal hashes mean equal tokens from position 0 on: the same KV. A request's
`cache_salt` (vLLM's) is the first block's parent (salt_root): requests with different salts share
no block, whatever their tokens. A sequence joining takes the longest chain of registered blocks its
tokens start with (`take_cached`), sharing them read-only (never written: a hit covers full blocks
only, and a sequence writes past its cached tokens). A freed block keeps its registration while it
sits on the free list, which is kept in least-recently-freed order: allocation takes from its front
and un-registers what it takes (an evicted block is never found again through its old hash), a hit
takes the block off the list.

A child of an n > 1 request forks a running sibling's prompt (`share`): the sibling's full blocks are
held by both (read-only: each writes past them), and the partial last block is copied into a block of
the child's own before either writes its next token there (the scheduler asks the model runner for the
copy: SchedulerOutput.copies).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict


class BlockTable:
    """The block ids holding one sequence's KV, in position order."""

    def __init__(self, owner: str):
        self.owner = owner
        self.block_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return f"BlockTable({self.owner!r}, {self.block_ids})"


def block_hashes(token_ids: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The chained hash of every full block of `token_ids`: sha256(parent hash, the block's ids);
    `parent`: the hash of the block before the first (none: the tokens start at position 0)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in block)).digest()
        hashes.append(parent)
    return hashes


def salt_root(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block: none without a salt, else the salt's own hash."""
    return b"" if cache_salt is None else hashlib.sha256(b"cache_salt:" + cache_salt.encode()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 count_shares: bool = True, evict_on_reuse: bool = True, unlist_hits: bool = True,
                 count_forks: bool = True):
        """`count_shares` False: Fault.CACHED_BLOCK_NOT_REFCOUNTED; `evict_on_reuse` False:
        Fault.EVICTED_BLOCK_STILL_CACHED; `unlist_hits` False: Fault.CACHED_BLOCK_LEFT_ON_FREE_LIST;
        `count_forks` False: Fault.FORKED_BLOCKS_NOT_REFCOUNTED (the engine resolves them from its config)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.count_shares, self.evict_on_reuse, self.unlist_hits = count_shares, evict_on_reuse, unlist_hits
        self.count_forks = count_forks
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.ref_counts = [0] * num_blocks
        self.tables: dict[str, BlockTable] = {}  # owner -> table holding blocks, for check_invariants
        self.cached: dict[bytes, int] = {}       # block hash -> the block holding that KV
        self.hash_of: dict[int, bytes] = {}      # block -> the hash it is registered under

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
            block_id, _ = self.free_block_ids.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] += 1
            table.block_ids.append(block_id)

    def free(self, table: BlockTable) -> None:
        """Give back the table's blocks, its tail first: a cached prefix's last blocks are evicted first."""
        for block_id in reversed(table.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None
        table.block_ids.clear()
        self.tables.pop(table.owner, None)

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Give back the blocks of `table` past its first `num_tokens` tokens (speculative decoding's
        rejected drafts), the last first, as `free` does."""
        while len(table.block_ids) > self.blocks_for(num_tokens):
            block_id = table.block_ids.pop()
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None

    # --- prefix caching ---------------------------------------------------------------------------
    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of `hashes` (none without caching)."""
        blocks = []
        for block_hash in hashes if self.enable_caching else ():
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def num_free_after_hit(self, blocks: list[int]) -> int:
        """Free blocks left once `blocks` (a hit) are taken: those of them on the free list leave it."""
        return len(self.free_block_ids) - sum(1 for b in blocks if self.ref_counts[b] == 0 and self.unlist_hits)

    def take_cached(self, table: BlockTable, blocks: list[int]) -> None:
        """Start an empty `table` with a hit's blocks, shared (their counts go up)."""
        assert not table.block_ids, table
        self.tables[table.owner] = table
        for block_id in blocks:
            if self.ref_counts[block_id] == 0:
                if self.unlist_hits:
                    del self.free_block_ids[block_id]
                self.ref_counts[block_id] += 1
            elif self.count_shares:
                self.ref_counts[block_id] += 1
            table.block_ids.append(block_id)

    def share(self, table: BlockTable, blocks: list[int]) -> None:
        """Start an empty `table` with `blocks`, which a sibling's table holds (a fork): their counts go up."""
        assert not table.block_ids, table
        self.tables[table.owner] = table
        for block_id in blocks:
            self.ref_counts[block_id] += self.count_forks
            table.block_ids.append(block_id)

    def register(self, table: BlockTable, hashes: list[bytes], first: int = 0) -> None:
        """Register the table's blocks `first` .. len(hashes) - 1 (full, their KV computed) under those
        `hashes`. A hash already registered keeps its block (this table's copy holds the same KV and stays
        private)."""
        if not self.enable_caching:
            return
        for block_id, block_hash in zip(table.block_ids[first:], hashes[first:]):
            if block_hash not in self.cached and block_id not in self.hash_of:
                self.cached[block_hash] = block_id
                self.hash_of[block_id] = block_hash

    def _evict(self, block_id: int) -> None:
        if not self.evict_on_reuse:
            return
        block_hash = self.hash_of.pop(block_id, None)
        if block_hash is not None:
            del self.cached[block_hash]

    def slot_mapping(self, table: BlockTable, start: int, end: int) -> list[int]:
        """Cache slots of positions start..end-1."""
        size, blocks = self.block_size, table.block_ids
        return [blocks[p // size] * size + p % size for p in range(start, end)]

    def check_invariants(self, finished_tables: list[BlockTable] = ()) -> None:
        """Raise AssertionError unless: free + used == total; each block's refcount equals the number
        of tables holding it; free blocks have refcount 0 and appear once; `finished_tables` are empty.
        Run after every step of every property, so whole lists are compared first and searched only
        for the message."""
        free = list(self.free_block_ids)
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
        if {b: h for h, b in self.cached.items()} != self.hash_of:
            raise AssertionError(f"the hash -> block map and the block -> hash map disagree: {len(self.cached)} "
                                 f"hashes, {len(self.hash_of)} registered blocks")
        for table in finished_tables:
            if table.block_ids:
                raise AssertionError(f"{table.owner}: finished but still holds blocks {table.block_ids}")
            if table.owner in self.tables:
                raise AssertionError(f"{table.owner}: finished but still registered")

"""Reference-counted blocks: L2's allocator interface (alloc / free / num_free / num_blocks), but a block
can sit in many block tables at once, and freeing returns references, not blocks.

Every block is in exactly one of three states:
  free      ref 0, no key    never used, or evicted: handed out first
  cached    ref 0, a key     nobody holds it, but its K/V is a known prefix: kept until evicted (LRU)
  held      ref >= 1         in ref block tables (with or without a key)
`num_free` counts free + cached: both can be handed out, cached ones by evicting them.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque

from lessons.l6_prefix_sharing.prefix_cache import PrefixCache
from lessons.l6_prefix_sharing.stats import PrefixStats
from shared.errors import PoolExhausted


class RefBlockManager:
    def __init__(self, num_blocks: int, cache: PrefixCache, stats: PrefixStats, pool=None):
        self.num_blocks, self.cache, self.stats = num_blocks, cache, stats
        self.pool = pool  # L3's BlockKvPool (or the fake runner's): copy-on-write copies its rows
        self.ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, least recently released first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._lru)

    # Task L6.2: ref-counted blocks: alloc (free ones, then evict the least recently released cached), share, free
    def alloc(self, n: int) -> list[int]:
        """n private blocks (ref 1). Free ones first; then evict the least recently released cached ones."""
        if n > self.num_free:
            raise PoolExhausted(needed=n, free=self.num_free, total=self.num_blocks)
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                self.cache.drop(b)  # its key must not name a block about to hold other tokens
                self.stats.evictions += 1
            self.ref[b] = 1
            blocks.append(b)
        return blocks

    # Task L6.2: ref-counted blocks: alloc (free ones, then evict the least recently released cached), share, free
    def share(self, blocks: list[int]) -> None:
        """One more reference to each block (a cache hit, or a fork). A cached block leaves the LRU."""
        for b in blocks:
            if self.ref[b] == 0:
                del self._lru[b]  # KeyError: an unreferenced block that is not cached is free, not shareable
            self.ref[b] += 1

    # Task L6.2: ref-counted blocks: alloc (free ones, then evict the least recently released cached), share, free
    def free(self, blocks: list[int]) -> None:
        """Return one reference per block. Tail first, so a prefix's deepest blocks are evicted first and
        its root, which every longer prefix needs, stays longest."""
        for b, n in Counter(blocks).items():
            if n > self.ref[b]:
                raise ValueError(f"block {b} freed more often than it is held")  # a bookkeeping bug
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.cache.is_cached(b):
                    self._lru[b] = None  # most recently released: evicted last
                else:
                    self._free.append(b)

    def is_shared(self, block: int) -> bool:
        return self.ref[block] > 1

    # Task L6.3: copy-on-write: before a write into a shared block, copy it (every layer, K and V) and take the copy
    def copy_on_write(self, block: int) -> int:
        """A private copy of a shared block (every layer, K and V); the caller's reference moves to it."""
        new = self.alloc(1)[0]
        self.copy_block(block, new)
        self.free([block])
        self.stats.cow_copies += 1
        return new

    # Task L6.3: copy-on-write: before a write into a shared block, copy it (every layer, K and V) and take the copy
    def copy_block(self, src: int, dst: int) -> None:
        for rows in self.pool.k + self.pool.v:
            rows[dst].copy_(rows[src])

    @property
    def num_cached_unheld(self) -> int:
        """Of num_free: the cached blocks nobody holds (a hit revives them; alloc evicts them last)."""
        return len(self._lru)

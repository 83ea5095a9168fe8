"""The prefix cache: full blocks named by a hash chain, so one key names a whole prefix.

key(block i) = hash(key(block i-1), the S token ids of block i), with key(block -1) = None. Equal keys
mean equal prefixes only if the hash never collides, so an entry also keeps the prefix's token ids and
a lookup compares them: a collision costs a miss, never wrong KV. `hash_fn` is injectable so a test can
force every key to collide. Everything here is Python ints and tuples; it never touches the pool.
"""
from __future__ import annotations

import hashlib
from typing import Callable

HashFn = Callable[["int | None", "tuple[int, ...]"], int]


def default_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    # Deterministic across processes (Python's hash() of a str is salted per run; blake2b is not).
    return int.from_bytes(hashlib.blake2b(repr((parent, tokens)).encode(), digest_size=8).digest(), "little")


# Task L6.1: hash-chained keys of full blocks; the cache maps key -> block, a collision is a miss
def chain_keys(tokens: list[int], keys: list[int], block_size: int, upto: int, hash_fn: HashFn,
               first: int = 0) -> list[int]:
    """Extend `keys` (the keys of the first len(keys) full blocks of `tokens`) to `upto` blocks; return it.
    Tokens only ever grow, so a request computes each of its keys once. `tokens` may start at position
    `first` (at most len(keys) blocks in): a decode then passes only the block it just filled."""
    for i in range(len(keys), upto):
        parent = keys[i - 1] if i else None
        at = i * block_size - first
        keys.append(hash_fn(parent, tuple(tokens[at:at + block_size])))
    return keys


class PrefixCache:
    def __init__(self, hash_fn: HashFn = default_hash):
        self.hash_fn = hash_fn
        self.block_of: dict[int, int] = {}  # key -> block holding that prefix's last S tokens' K/V
        self.entry: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (key, every token of the prefix)

    def __len__(self) -> int:
        return len(self.entry)

    def is_cached(self, block: int) -> bool:
        return block in self.entry

    # Task L6.1: hash-chained keys of full blocks; the cache maps key -> block, a collision is a miss
    def lookup(self, key: int, prefix: tuple[int, ...]) -> int | None:
        block = self.block_of.get(key)
        if block is None or self.entry[block][1] != prefix:  # a collision: a miss, not somebody else's KV
            return None
        return block

    # Task L6.1: hash-chained keys of full blocks; the cache maps key -> block, a collision is a miss
    def register(self, block: int, key: int, prefix: tuple[int, ...]) -> bool:
        """Name a block whose K/V has been written. The first writer of a prefix wins: a second block with
        the same prefix (two requests prefilled it in one step) or a colliding key stays private."""
        if block in self.entry or key in self.block_of:
            return False
        self.block_of[key] = block
        self.entry[block] = (key, prefix)
        return True

    # Task L6.1: hash-chained keys of full blocks; the cache maps key -> block, a collision is a miss
    def drop(self, block: int) -> None:
        """Forget a block (it is being evicted for reuse)."""
        key, _ = self.entry.pop(block)
        del self.block_of[key]

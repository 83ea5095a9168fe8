"""The prefix cache: full blocks named by a hash chain, so one key names a whole prefix.

key(block i) = hash(key(block i-1), the S token ids of block i), with key(block -1) = None. Equal keys
mean equal prefixes only if the hash never collides, so an entry also keeps its block's S token ids and the
entry of the prefix one block shorter (its parent, named by an ident no later entry gets), and a lookup
compares both: the request's block i matches an entry only if its tokens are the entry's and the entry its
block i-1 matched is the entry's parent. By induction a hit is the request's whole prefix, and a collision
costs a miss, never wrong KV; yet each entry holds S tokens, not its whole prefix, so the cache's memory and
a lookup's work grow linearly with the tokens cached. `hash_fn` is injectable so a test can force every key
to collide. Everything here is Python ints and tuples; it never touches the pool.
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Callable, NamedTuple

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


Ident = tuple[int, int]  # (block, registration number): an entry's name, never reused by a later entry


class Entry(NamedTuple):
    key: int
    ident: Ident  # a block evicted and filled again is a new entry with a new ident
    parent: Ident | None  # the entry of the prefix one block shorter (None: the first block)
    tokens: tuple[int, ...]  # this block's S token ids


class PrefixCache:
    def __init__(self, hash_fn: HashFn = default_hash):
        self.hash_fn = hash_fn
        self.block_of: dict[int, int] = {}  # key -> block holding that prefix's last S tokens' K/V
        self.entry: dict[int, Entry] = {}  # block -> its entry
        self.registrations = itertools.count()  # numbers each entry's ident

    def ident(self, block: int) -> Ident | None:
        """The ident of a cached block's entry (None: the block is not cached): the parent a lookup or a
        registration of the next block names."""
        entry = self.entry.get(block)
        return None if entry is None else entry.ident

    def __len__(self) -> int:
        return len(self.entry)

    def is_cached(self, block: int) -> bool:
        return block in self.entry

    def prefix(self, block: int) -> tuple[int, ...] | None:
        """The whole prefix a cached block ends, walked back through its parents: for inspection (tests, the
        walkthrough), never on the engine's path. None if the block, or a parent, has left the cache."""
        parts, entry = [], self.entry.get(block)
        while entry is not None:
            parts.append(entry.tokens)
            if entry.parent is None:
                return tuple(t for part in reversed(parts) for t in part)
            parent, entry = entry.parent, self.entry.get(entry.parent[0])
            if entry is not None and entry.ident != parent:  # the parent's block holds a later entry now
                return None
        return None

    # Task L6.1: hash-chained keys of full blocks; the cache maps key -> block, a collision is a miss
    def lookup(self, key: int, parent: Ident | None, tokens: tuple[int, ...]) -> int | None:
        """The block cached under `key`, if its entry holds `tokens` after the entry `parent` (the ident of the
        block before it in the request's chain, None for the first block); else None."""
        block = self.block_of.get(key)
        if block is None:
            return None
        entry = self.entry[block]
        if entry.parent != parent or entry.tokens != tokens:  # a collision: a miss, not somebody else's KV
            return None
        return block

    # Task L6.1: hash-chained keys of full blocks; the cache maps key -> block, a collision is a miss
    def register(self, block: int, key: int, parent: Ident | None, tokens: tuple[int, ...]) -> bool:
        """Name a block whose K/V has been written: its S `tokens` after the cached entry `parent`. The first
        writer of a prefix wins: a second block with the same prefix (two requests prefilled it in one step)
        or a colliding key stays private."""
        if block in self.entry or key in self.block_of:
            return False
        self.block_of[key] = block
        self.entry[block] = Entry(key, (block, next(self.registrations)), parent, tokens)
        return True

    # Task L6.1: hash-chained keys of full blocks; the cache maps key -> block, a collision is a miss
    def drop(self, block: int) -> None:
        """Forget a block (it is being evicted for reuse)."""
        del self.block_of[self.entry.pop(block).key]

"""L6's build-track tests (scripts/course.py check L6): the prefix cache, the ref-counted blocks, copy-on-write,
the match, admission, registration and forks, each on its own, with no model; the engine's are marked in
test_l6_exact_counts.py, test_l6_scheduler.py, test_l6_fork.py and test_l6_parity.py."""
import pytest
import torch

from fake_runner import FakePool
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from lessons.l6_prefix_sharing.block_manager import RefBlockManager
from lessons.l6_prefix_sharing.prefix_cache import PrefixCache, chain_keys, default_hash
from lessons.l6_prefix_sharing.scheduler import PrefixScheduler
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l6_prefix_sharing.stats import PrefixStats
from shared.errors import PoolExhausted
from shared.generation import StopRule

P = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 10 tokens: with S = 4, two full blocks and 2 tokens in a third


def manager(num_blocks: int, hash_fn=default_hash, pool=None) -> RefBlockManager:
    return RefBlockManager(num_blocks, PrefixCache(hash_fn), PrefixStats(), pool)


def scheduler(num_blocks: int, S: int = 4, max_running: int = 4, wait: bool = True, hash_fn=default_hash) -> PrefixScheduler:
    m = manager(num_blocks, hash_fn, FakePool(num_blocks, S))
    return PrefixScheduler(m, S, max_running, m.stats, wait)


def seq(tokens: list[int], seq_id: int = 0, S: int = 4) -> SharedSequence:
    return SharedSequence(list(tokens), S, seq_id=seq_id, stop=StopRule(1))


def cache_blocks(sched: PrefixScheduler, tokens: list[int], n: int) -> list[int]:
    """What an earlier request that computed `tokens` leaves behind: its first n full blocks cached, nobody
    holding them (in the LRU)."""
    S, m = sched.block_size, sched.allocator
    blocks = m.alloc(n)
    keys = chain_keys(tokens, [], S, n, sched.cache.hash_fn)
    for i, b in enumerate(blocks):
        parent = sched.cache.ident(blocks[i - 1]) if i else None
        sched.cache.register(b, keys[i], parent, tuple(tokens[i * S:(i + 1) * S]))
    m.free(blocks)
    return blocks


# --- task 1: the keys and the cache ---


@pytest.mark.task("L6.1")
def test_each_key_chains_its_parent_key_and_its_own_block():
    tokens, S = [5, 6, 5, 6, 5, 6, 9], 2
    keys = chain_keys(tokens, [], S, 3, default_hash)
    assert len(keys) == 3, f"chain_keys(..., upto=3) gave {len(keys)} keys; want one per full block, 3"
    assert keys[0] == default_hash(None, (5, 6)), "block 0's key is hash_fn(None, its S tokens)"
    assert keys[1] == default_hash(keys[0], (5, 6)), "block 1's key is hash_fn(block 0's key, its S tokens)"
    assert keys[2] == default_hash(keys[1], (5, 6)), "block 2's key is hash_fn(block 1's key, its S tokens)"
    assert len(set(keys)) == 3, "three blocks with the same tokens at depths 0, 1, 2 must get three keys"
    known = keys[:1]
    assert chain_keys(tokens, known, S, 3, default_hash) is known and known == keys, \
        "chain_keys extends the list it is given (the keys already known are not computed again) and returns it"
    assert chain_keys(tokens[4:], keys[:2], S, 3, default_hash, first=4) == keys, \
        "with first=4, tokens starts at position 4: block 2 is tokens[0:2] there"
    assert chain_keys(tokens, [], S, 0, default_hash) == [], "upto=0: no keys"


@pytest.mark.task("L6.1")
def test_the_cache_finds_a_prefix_by_key_and_a_collision_is_a_miss():
    cache = PrefixCache(lambda parent, tokens: 0)  # every key collides
    assert cache.register(3, 0, None, (1, 2)), "the first block registered under a key is cached (register is True)"
    assert cache.is_cached(3) and len(cache) == 1
    root = cache.ident(3)
    assert root is not None and cache.ident(4) is None, "ident names a cached block's entry, None for others"
    assert cache.lookup(0, None, (1, 2)) == 3, "lookup(key, parent, tokens) gives the block registered with them"
    assert cache.lookup(0, None, (7, 7)) is None, "same key, other tokens: a collision must be a miss, not block 3's"
    assert cache.lookup(0, root, (1, 2)) is None, "same key and tokens after another parent: a longer prefix, a miss"
    assert cache.lookup(99, None, (1, 2)) is None, "an unknown key is a miss"
    assert not cache.register(5, 0, None, (7, 7)), "a second block under a taken key stays private (register False)"
    assert not cache.register(3, 42, None, (1, 2)), "a block already cached is not registered a second time"
    assert cache.lookup(0, None, (1, 2)) == 3 and not cache.is_cached(5), "a refused register changes nothing"
    cache.drop(3)
    assert not cache.is_cached(3) and len(cache) == 0, "drop(3) forgets block 3"
    assert cache.lookup(0, None, (1, 2)) is None, "after drop(3), its key must not name block 3 any more"
    assert cache.register(5, 0, None, (7, 7)), "after the drop, the key is free for another block"
    assert cache.register(3, 1, None, (1, 2)) and cache.ident(3) != root, \
        "a block cached again is a new entry: its ident is never an earlier entry's"


@pytest.mark.task("L6.1")
def test_a_child_whose_parent_was_evicted_and_refilled_is_a_miss():
    """Block 3 held [1, 2] and block 4 the next block [5, 6] after it. Block 3 is evicted and filled with [7, 8]:
    with every key colliding, a request [7, 8, 5, 6] must not take block 4 (computed after [1, 2])."""
    cache = PrefixCache(lambda parent, tokens: hash((parent, tokens)) % 3)  # few keys: collisions everywhere
    cache.register(3, 0, None, (1, 2))
    cache.register(4, 1, cache.ident(3), (5, 6))
    assert cache.lookup(1, cache.ident(3), (5, 6)) == 4, "block 4 after block 3's entry: a hit"
    cache.drop(3)
    cache.register(3, 0, None, (7, 8))
    assert cache.lookup(0, None, (7, 8)) == 3
    assert cache.lookup(1, cache.ident(3), (5, 6)) is None, \
        "block 4's parent is the entry block 3 had before it was refilled: [7, 8, 5, 6] is not its prefix"


# --- task 2: reference counts, the LRU, eviction ---


@pytest.mark.task("L6.2")
def test_alloc_hands_out_free_blocks_then_evicts_the_least_recently_released():
    m = manager(4)
    a = m.alloc(2)
    assert a == [0, 1] and m.ref[:2] == [1, 1], f"alloc(2) on a fresh pool gave {a}, refs {m.ref}; want [0, 1], ref 1"
    for i, b in enumerate(a):
        m.cache.register(b, 100 + i, None, (i,))
    m.free(a)
    assert m.ref == [0, 0, 0, 0] and m.num_free == 4, "freed cached blocks count as free (they can be evicted)"
    assert list(m._lru) == [1, 0], f"the LRU is {list(m._lru)}: free returns the tail first, so block 1 goes first"
    assert m.alloc(2) == [2, 3] and m.stats.evictions == 0, "never-used blocks are handed out before cached ones"
    got = m.alloc(1)
    assert got == [1], f"with no free block, alloc evicts the least recently released cached block (1), got {got}"
    assert m.stats.evictions == 1 and not m.cache.is_cached(1), "an evicted block leaves the cache (drop) and counts"
    assert m.cache.is_cached(0) and list(m._lru) == [0]
    with pytest.raises(PoolExhausted):
        m.alloc(2)
    assert m.num_free == 1 and list(m._lru) == [0] and m.cache.is_cached(0), "a failed alloc changes nothing"


@pytest.mark.task("L6.2")
def test_share_and_free_count_references():
    m = manager(4)
    b = m.alloc(1)[0]
    m.share([b, b])
    assert m.ref[b] == 3, f"block {b} was allocated once and shared twice: ref {m.ref[b]}, want 3"
    m.free([b])
    assert m.ref[b] == 2 and m.num_free == 3, "free returns one reference; block still held, not free"
    with pytest.raises(ValueError):
        m.free([b, b, b])  # 3 references returned, 2 held: a bookkeeping bug
    assert m.ref[b] == 2, "a refused free changes nothing"
    m.free([b, b])
    assert m.ref[b] == 0 and m.num_free == 4 and b in m._free, "an uncached block with no holder is free again"
    c = m.alloc(1)[0]
    m.cache.register(c, 7, None, (1,))
    m.free([c])
    assert c in m._lru and c not in m._free, "a cached block with no holder waits in the LRU, not the free list"
    m.share([c])
    assert m.ref[c] == 1 and c not in m._lru and m.num_free == 3, "a hit on a cached block takes it out of the LRU"
    with pytest.raises(KeyError):
        m.share([b])  # free and not cached: nothing in it to share


# --- task 3: copy-on-write ---


@pytest.mark.task("L6.3")
def test_a_write_into_a_shared_block_copies_it_first():
    S, m = 4, manager(6, pool=FakePool(6, 4))
    parent = seq(P[:6])  # 6 tokens: block 0 full, block 1 holds 2 of 4
    parent.reserve(6, m)
    for layer, (k, v) in enumerate(zip(m.pool.k, m.pool.v)):
        k[parent.blocks[1]] = torch.arange(S, dtype=torch.float32).view(S, 1, 1) + 10 * layer
        v[parent.blocks[1]] = -torch.arange(S, dtype=torch.float32).view(S, 1, 1) - 10 * layer
    parent.num_cached = 6
    child = SharedSequence(list(P[:6]), S, seq_id=1, blocks=list(parent.blocks), num_cached=6)
    m.share(parent.blocks)
    table = child.blocks
    old = table[1]
    child.output_ids.append(99)  # the next write: position 6, in the shared block 1
    child.reserve(7, m)
    assert child.blocks[0] == parent.blocks[0], "block 0 is full: nothing will be written there, keep sharing it"
    new = child.blocks[1]
    assert new != old, f"position 6 lands in shared block {old}: the child must write into a copy of it"
    assert table == parent.blocks, "the copy must go into a new table list (the old list is never changed in place)"
    assert m.ref[old] == 1 and m.ref[new] == 1, f"refs: old block {m.ref[old]}, copy {m.ref[new]}; want 1 and 1"
    assert m.stats.cow_copies == 1, "one copy-on-write counted"
    for layer, (k, v) in enumerate(zip(m.pool.k, m.pool.v)):
        assert torch.equal(k[new], k[old]) and torch.equal(v[new], v[old]), \
            f"layer {layer}: the copy of block {old} into {new} must copy K and V of every layer"
    child.output_ids.append(98)
    child.reserve(8, m)
    assert child.blocks[1] == new and m.stats.cow_copies == 1, "a private block is written in place: no second copy"


@pytest.mark.task("L6.3")
def test_copy_on_write_is_all_or_nothing():
    S, m = 4, manager(3, pool=FakePool(3, 4))
    parent = seq(P[:8])
    parent.reserve(8, m)  # blocks 0, 1; one free block left
    parent.num_cached = 6  # pretend: its next write is position 6, in block 1
    m.share(parent.blocks)  # a sibling holds them too
    with pytest.raises(PoolExhausted):
        parent.reserve(9, m)  # a copy of block 1 and a third block: 2 needed, 1 free
    assert parent.blocks == [0, 1] and m.ref == [2, 2, 0] and m.stats.cow_copies == 0, \
        f"a reserve that cannot get every block changes nothing: table {parent.blocks}, refs {m.ref}"


# --- task 4: the match ---


@pytest.mark.task("L6.4")
def test_match_finds_the_longest_cached_chain_and_leaves_a_token_to_feed():
    sched = scheduler(8)
    blocks = cache_blocks(sched, P, 2)  # P's blocks 0 (11..14) and 1 (15..18)
    got = sched.match(seq(P[:9]))
    assert got == blocks, f"9 tokens: both cached blocks are a prefix and 8 < 9, so both hit; got {got}"
    got = sched.match(seq(P[:8]))
    assert got == blocks[:1], (f"8 tokens = exactly 2 cached blocks; at most (8 - 1) // 4 = 1 may hit (one token "
                               f"is left to feed for its logits); got {got}")
    got = sched.match(seq(P[:4] + [0, 0, 0, 0, 1]))
    assert got == blocks[:1], f"block 1 differs: the chain stops after block 0; got {got}"
    got = sched.match(seq([0] + P[1:9]))
    assert got == [], f"block 0 differs: block 1's key chains block 0's, so nothing hits; got {got}"
    assert sched.match(seq(P[:3])) == [], "a request shorter than a block has no full block to hit"


@pytest.mark.task("L6.4")
def test_a_colliding_key_is_a_miss_in_the_match():
    sched = scheduler(8, hash_fn=lambda parent, tokens: 0)  # every key is 0
    cache_blocks(sched, P, 1)
    got = sched.match(seq([1, 2, 3, 4, 5]))
    assert got == [], f"key 0 names block 0, which holds other tokens: a miss, not a hit; got {got}"


# --- task 5: admission ---


@pytest.mark.task("L6.5")
def test_admission_shares_the_hits_and_allocates_only_the_rest():
    sched = scheduler(8)
    blocks = cache_blocks(sched, P, 2)
    s = seq(P)
    sched.add(s)
    sched.admit()
    assert sched.running == [s] and s.status is Status.RUNNING, "a request that fits is admitted"
    assert s.blocks[:2] == blocks, f"its table {s.blocks} must start with the cached blocks {blocks}"
    assert len(s.blocks) == 3, f"10 tokens need 3 blocks: 2 hits and 1 fresh; it holds {len(s.blocks)}"
    assert s.num_cached == 8, f"num_cached {s.num_cached}: the 8 tokens of the hits are not computed again"
    assert s.extra["registered"] == 2, "the hits count as registered (they are in the cache already)"
    m = sched.allocator
    assert [m.ref[b] for b in s.blocks] == [1, 1, 1] and not m._lru, "hits are held now: ref 1, out of the LRU"
    st = sched.stats
    assert (st.prompt_tokens, st.cached_tokens, st.prefill_tokens) == (10, 8, 2), \
        f"stats (prompt, cached, prefill) = {(st.prompt_tokens, st.cached_tokens, st.prefill_tokens)}, want (10, 8, 2)"


@pytest.mark.task("L6.5")
def test_reviving_cached_blocks_counts_against_the_free_ones():
    """4 blocks: 2 cached in the LRU (counted in num_free), 1 held by another request, 1 free. A 14-token
    request hits both cached blocks and needs 2 fresh ones: 2 <= num_free 3, but sharing the hits takes
    them out of num_free: 2 + 2 > 3, so it waits."""
    sched = scheduler(4)
    cache_blocks(sched, P, 2)
    m = sched.allocator
    other = m.alloc(1)
    s = seq(P + [1, 2, 3, 4])
    sched.add(s)
    sched.admit()
    assert sched.running == [] and list(sched.waiting) == [s], "it does not fit: it must keep waiting"
    assert s.blocks == [] and m.ref == [0, 0, 1, 0] and list(m._lru) == [1, 0] and other == [2], \
        f"a refused admission changes nothing: refs {m.ref}, LRU {list(m._lru)}"


@pytest.mark.task("L6.5")
@pytest.mark.parametrize("wait", [True, False])
def test_a_request_waits_for_a_block_in_flight_and_is_passed(wait):
    """R computes P's blocks this step; W shares P's first 8 tokens; U shares nothing. With wait_for_inflight
    W waits (one step later R's blocks are hits) and U, behind it, is admitted; without it all three run."""
    sched = scheduler(16, wait=wait)
    r, w, u = seq(P, 0), seq(P[:8] + [7, 7], 1), seq([50, 51], 2)
    for s in (r, w, u):
        sched.add(s)
    sched.admit()
    running, waiting = [s.seq_id for s in sched.running], [s.seq_id for s in sched.waiting]
    if wait:
        assert (running, waiting) == ([0, 2], [1]), \
            f"running {running}, waiting {waiting}: W (1) should wait for R's blocks in flight and U (2) pass it"
    else:
        assert (running, waiting) == ([0, 1, 2], []), f"running {running}, waiting {waiting}: no waiting, all run"
        assert set(w.blocks).isdisjoint(r.blocks), "nothing was written yet: W cannot hit R's blocks"


# --- task 6: registration ---


@pytest.mark.task("L6.6")
def test_blocks_are_registered_once_written_generated_tokens_included():
    sched = scheduler(8)
    s = seq(P)
    sched.add(s)
    sched.admit()
    sched.register_written([s])
    assert len(sched.cache) == 0, "before the forward (num_cached 0) nothing is written: nothing may be registered"
    s.num_cached = 10  # the forward wrote all 10 tokens
    sched.register_written([s])
    entries = {b: (e.parent, e.tokens) for b, e in sched.cache.entry.items()}
    want = {s.blocks[0]: (None, tuple(P[:4])), s.blocks[1]: (sched.cache.ident(s.blocks[0]), tuple(P[4:8]))}
    assert entries == want, (f"after 10 tokens: blocks 0 and 1 (full) are cached, each with its tokens after its "
                             f"parent's entry; got {entries}")
    assert s.extra["registered"] == 2
    assert sched.match(seq(P + [0], 1)) == s.blocks[:2], "a later request with the same prefix hits both"
    s.output_ids += [21, 22]  # two decode steps: positions 10, 11 written, block 2 full
    s.num_cached = 12
    sched.register_written([s])
    entry = sched.cache.entry.get(s.blocks[2])
    assert entry is not None and entry.tokens == tuple(P[8:] + [21, 22]), \
        "block 2, filled by generated tokens, is registered with its own 4 tokens"
    assert entry.parent == sched.cache.ident(s.blocks[1]), "after block 1's entry"
    assert s.extra["registered"] == 3 and len(sched.cache) == 3


# --- task 7: forks (the step's tests are marked in the engine test files) ---


@pytest.mark.task("L6.7")
def test_fork_shares_every_block_and_queues_siblings_without_a_slot():
    sched = scheduler(8, max_running=3)
    parent = seq(P[:6])
    kids = [SharedSequence(list(P[:6]), 4, seq_id=i, sampling=SamplingParams(1.0, seed=i)) for i in (1, 2, 3)]
    parent.extra["forks"] = kids
    sched.add(parent)
    sched.admit()
    parent.num_cached = 6  # its prefill ran
    sched.register_written([parent])
    joined = sched.fork(parent)
    assert joined == kids[:2], f"max_running 3: the parent and 2 siblings run; joined {[k.seq_id for k in joined]}"
    for k in joined:
        assert k.blocks == parent.blocks and k.blocks is not parent.blocks, \
            f"sibling {k.seq_id} holds the parent's blocks, in a table list of its own"
        assert k.num_cached == 6 and k.status is Status.RUNNING, f"sibling {k.seq_id}: written 6, running"
        assert k.extra["registered"] == 1, "a sibling shares the parent's registration count"
    assert [sched.allocator.ref[b] for b in parent.blocks] == [3, 3], "each block is held by 3 tables"
    assert [s.seq_id for s in sched.running] == [0, 1, 2], "running stays in arrival order"
    assert list(sched.waiting) == [kids[2]] and kids[2].blocks == [], "sibling 3 waits, holding nothing"
    assert sched.fork(parent) == [], "a parent forks once"

"""L6's scheduler: L5's (recompute preemption), with admission that reuses cached prefix blocks,
registration of blocks once their K/V is written, and forks for parallel sampling.

A request's bookkeeping in `seq.extra`: "keys", the hash-chain keys of its full blocks (tokens only grow,
so they never go stale); "registered", how many of its leading blocks are hits or were offered to the
cache; "forks", the sibling sequences (n > 1) waiting for this one's prefill.

Admission is first come, first served with one exception: a request waiting for a block in flight is
passed by those behind it (it is admitted once the block is written). Siblings that find no free slot at
the fork wait in the queue in their place, so `waiting` and `running` are both kept in arrival order.
"""
from __future__ import annotations

from bisect import insort

from lessons.l2_token_flat.engine import blocks_for
from lessons.l4_continuous.sequence import Status
from lessons.l5_preemption.scheduler import PreemptingScheduler
from lessons.l6_prefix_sharing.block_manager import RefBlockManager
from lessons.l6_prefix_sharing.prefix_cache import chain_keys
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l6_prefix_sharing.stats import PrefixStats


class PrefixScheduler(PreemptingScheduler):
    def __init__(self, manager: RefBlockManager, block_size: int, max_running: int, stats: PrefixStats,
                 wait_for_inflight: bool = True):
        super().__init__(manager, block_size, max_running, "recompute", None, stats)
        self.cache, self.wait_for_inflight = manager.cache, wait_for_inflight

    def keys(self, seq: SharedSequence, upto: int) -> list[int]:
        keys = seq.extra.setdefault("keys", [])
        first = len(keys) * self.block_size  # only the blocks not keyed yet are read: one, for a decode
        tokens = seq.token_ids(first, upto * self.block_size)
        return chain_keys(tokens, keys, self.block_size, upto, self.cache.hash_fn, first)

    # Task L6.4: the longest chain of cached blocks that prefixes a request, at most (num_tokens - 1) // S deep
    def match(self, seq: SharedSequence) -> list[int]:
        """The longest chain of cached blocks that is a prefix of the request's tokens. At most
        (num_tokens - 1) // S blocks: at least one token is always left to feed (its logits give the next
        token), and it lands in a fresh block, never in a shared full one."""
        tokens, S = seq.all_tokens(), self.block_size
        limit = (len(tokens) - 1) // S
        hits, parent = [], None
        for i, key in enumerate(self.keys(seq, limit)[:limit]):  # keys may run further (pending_keys)
            block = self.cache.lookup(key, parent, tuple(tokens[i * S:(i + 1) * S]))
            if block is None:
                break
            hits.append(block)
            parent = self.cache.ident(block)
        return hits

    # Task L6.5: admission: share the hits, allocate the rest; wait for a block a running request is filling
    def admit(self) -> None:
        """Waiting requests in queue order (no swap in L6): cached prefix shared, only the rest allocated."""
        inflight = self.inflight_keys() if self.wait_for_inflight else set()
        for seq in list(self.waiting):
            if len(self.running) >= self.max_running:
                return
            hits = self.match(seq)
            if self.waits_for(seq, hits, inflight):
                continue  # one step later its next block is a hit; the requests behind it need not wait too
            fresh = blocks_for(seq.num_tokens, self.block_size) - len(hits)
            if fresh + self.revived(hits) > self.allocator.num_free:
                return  # head of line for memory: nothing younger overtakes it, or it could starve
            self.waiting.remove(seq)
            self.allocator.share(hits)  # first: alloc below must not evict the blocks just hit
            seq.blocks = hits + self.allocator.alloc(fresh)
            seq.num_cached = len(hits) * self.block_size  # BatchMeta feeds num_cached .. num_tokens - 1
            seq.extra["registered"], seq.extra["chain"] = len(hits), self.cache.ident(hits[-1]) if hits else None
            self.stats.prompt_tokens += seq.num_tokens
            self.stats.cached_tokens += seq.num_cached
            self.stats.prefill_tokens += seq.num_tokens - seq.num_cached
            self._run(seq)
            if self.wait_for_inflight:
                inflight |= self.pending_keys(seq)

    # Task L6.5: admission: share the hits, allocate the rest; wait for a block a running request is filling
    def waits_for(self, seq: SharedSequence, hits: list[int], inflight: set[int]) -> bool:
        """Whether the block after `seq`'s hits is being computed by a running request: then it waits and
        hits that block once it is written, instead of computing it a second time."""
        limit = (seq.num_tokens - 1) // self.block_size
        return len(hits) < limit and self.keys(seq, limit)[len(hits)] in inflight

    def _run(self, seq: SharedSequence) -> None:
        seq.status, seq.admitted_at = Status.RUNNING, self.step_no
        insort(self.running, seq, key=lambda s: s.seq_id)  # an older request may be admitted after a younger one

    def queue(self, seq: SharedSequence) -> None:
        """Into `waiting` at its arrival place (a passed request, a sibling, a preempted one may be older
        than some already queued)."""
        seq.status = Status.WAITING
        at = next((i for i, s in enumerate(self.waiting) if s.seq_id > seq.seq_id), len(self.waiting))
        self.waiting.insert(at, seq)

    # Task L6.5: admission: share the hits, allocate the rest; wait for a block a running request is filling
    def pending_keys(self, seq: SharedSequence) -> set[int]:
        """Keys of the blocks this step's forward fills for `seq` (not cached yet: not written yet)."""
        full, done = seq.num_tokens // self.block_size, seq.extra.get("registered", 0)
        return set(self.keys(seq, full)[done:full]) if full > done else set()

    def inflight_keys(self) -> set[int]:
        return set().union(*(self.pending_keys(s) for s in self.running))

    def revived(self, hits: list[int]) -> int:
        """Hits nobody holds are counted in num_free (evictable); sharing them takes them out of it."""
        return sum(1 for b in hits if self.allocator.ref[b] == 0)

    def fits_now(self, seq: SharedSequence) -> bool:
        hits = self.match(seq)
        return blocks_for(seq.num_tokens, self.block_size) - len(hits) + self.revived(hits) <= self.allocator.num_free

    def preempt(self, seq: SharedSequence) -> None:
        super().preempt(seq)  # recompute: references returned, num_cached = 0; its cached blocks stay cached
        seq.extra["registered"] = 0
        self.waiting.remove(seq)  # L5 put it at the front; an older request passed over may be queued
        self.queue(seq)

    # Task L6.6: after the forward, register every block a request has filled (never earlier)
    def register_written(self, batch: list[SharedSequence]) -> None:
        """After the forward: every block a request has now filled (num_cached // S of them) enters the
        cache. Never earlier: a block registered at allocation could be hit before its K/V exists."""
        for seq in batch:
            full, done = seq.num_cached // self.block_size, seq.extra.get("registered", 0)
            if full <= done:
                continue
            keys, S = self.keys(seq, full), self.block_size
            parent = seq.extra.get("chain") if done else None  # the entry holding its prefix through block done - 1
            for i in range(done, full):
                if i and parent is None:  # that prefix has left the cache: no entry after it could be reached
                    break
                tokens = tuple(seq.token_ids(i * S, (i + 1) * S))
                self.cache.register(seq.blocks[i], keys[i], parent, tokens)
                found = self.cache.lookup(keys[i], parent, tokens)  # its own block, or a twin's registered first
                parent = None if found is None else self.cache.ident(found)
            seq.extra["registered"], seq.extra["chain"] = full, parent

    # Task L6.7: parallel sampling: fork siblings onto the parent blocks; the step samples them from its row
    def fork(self, parent: SharedSequence) -> list[SharedSequence]:
        """Parallel sampling: right after the parent's prefill, its siblings join holding the same blocks,
        the partly filled last one included. Whoever writes into that one first copies it (reserve).
        Siblings count against max_running: those without a slot queue in their arrival place, holding
        nothing, and are admitted like any request (their prompt then hits the blocks the parent cached).
        Returns the siblings that joined: they sample their first token from the parent's logits."""
        children = parent.extra.pop("forks", [])
        joined = children[:self.max_running - len(self.running)]
        for child in joined:
            self.allocator.share(parent.blocks)
            child.blocks, child.num_cached = list(parent.blocks), parent.num_cached
            child.extra["keys"] = list(parent.extra.get("keys", []))
            child.extra["registered"] = parent.extra.get("registered", 0)
            child.extra["chain"] = parent.extra.get("chain")
            self._run(child)  # siblings take their ids' place: `running` stays in arrival order (L5's victim rule)
        for child in children[len(joined):]:
            self.queue(child)
        return joined

"""L8's scheduler: no prefill phase and no decode phase, one token budget per step.

Every running request has a computed count (num_cached) catching up with its token count. Each step
spends at most `max_batched_tokens` tokens, in this order:
  1. decodes (running requests one token behind): one token each, the least recently fed first, so when
     the budget is smaller than the number of decodes they take turns;
  2. running requests part-way through their prompt, oldest first;
  3. waiting requests, oldest first, after their prefix-cache hit (one waiting for blocks in flight is passed).
Each of 2 and 3 takes what it still needs, capped by what is left of the budget and by the optional
per-request `max_slice_tokens`. Blocks are reserved for each slice's end, not the whole prompt.

Optionally (`max_long_prefills` K with `long_prefill_threshold` T, vLLM's max_long_partial_prefills and
long_prefill_token_threshold): a prompt with more than T tokens still to compute is long; a slice is at
most T tokens, and at most K long prompts are part-way through at once. A long waiting prompt beyond
them is passed by the shorter ones behind it, so short prompts are not queued behind long ones.

When a slice cannot get its blocks the youngest running request is preempted (L5's victim rule,
recompute only, as in L6); if it was already scheduled this step its tokens go back to the budget. The
oldest request always gets its blocks, so the run always progresses.
"""
from __future__ import annotations

from lessons.l2_token_flat.engine import blocks_for
from lessons.l4_continuous.sequence import Status
from lessons.l6_prefix_sharing.block_manager import RefBlockManager
from lessons.l6_prefix_sharing.scheduler import PrefixScheduler
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l6_prefix_sharing.stats import PrefixStats
from lessons.l8_chunked_prefill.slice import Slice
from shared.errors import CourseError, PoolExhausted

DEFAULT_MAX_BATCHED_TOKENS = 64  # on a CPU a step's time grows with its tokens: 64 keeps any one step short


def check_budget(value: object, name: str, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CourseError(f"{name} must be an integer of at least 1, got {value!r}")


def check_long_prefills(max_long_prefills: object, threshold: object) -> None:
    """The two go together: a limit on long prompts needs what "long" means, and the reverse."""
    check_budget(max_long_prefills, "max-long-prefills", allow_none=True)
    check_budget(threshold, "long-prefill-threshold", allow_none=True)
    if (max_long_prefills is None) != (threshold is None):
        given, value, missing = (("max-long-prefills", max_long_prefills, "long-prefill-threshold") if threshold is None
                                 else ("long-prefill-threshold", threshold, "max-long-prefills"))
        raise CourseError(f"{given} {value!r} needs {missing} too: the limit and what counts as long go together")


class ChunkedScheduler(PrefixScheduler):
    def __init__(self, manager: RefBlockManager, block_size: int, max_running: int, stats: PrefixStats,
                 wait_for_inflight: bool = True, max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
                 max_slice_tokens: int | None = None, max_long_prefills: int | None = None,
                 long_prefill_threshold: int | None = None):
        super().__init__(manager, block_size, max_running, stats, wait_for_inflight)  # budgets: L8Engine checks them
        self.max_batched_tokens, self.max_slice_tokens = max_batched_tokens, max_slice_tokens
        self.max_long_prefills, self.long_prefill_threshold = max_long_prefills, long_prefill_threshold
        caps = [c for c in (max_slice_tokens, long_prefill_threshold) if c is not None]
        self.slice_cap = min(caps) if caps else None  # no prompt slice is longer
        self.budget = 0  # tokens left in the step being scheduled
        self.plan: list[Slice] = []  # the step being scheduled

    # Task L8.4: the plan: decodes (least recently fed first), then prompt slices, then admissions
    def schedule(self) -> list[Slice]:
        self.step_no += 1
        self.budget, self.plan = self.max_batched_tokens, []
        # A decode has sampled before and is one token behind; anything else running is part-way through
        # its prompt (a prompt's last token included: it is a slice, fed after every decode).
        decodes = [s for s in self.running if s.num_tokens - s.num_cached == 1 and s.output_ids]
        decodes.sort(key=lambda s: (s.extra.get("fed_at", -1), s.seq_id))  # longest unfed first; ties: oldest
        prefills = [s for s in self.running if s not in decodes]  # running is in arrival order
        preemptions = self.stats.preemptions
        for seq, decode in [(s, True) for s in decodes] + [(s, False) for s in prefills]:
            if self.budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this step, as someone's victim
            n = 1 if decode else self.slice_size(seq.num_tokens - seq.num_cached)
            if self.reserve(seq, seq.num_cached + n):
                self.take(Slice.of(seq, n, decode))
        if self.stats.preemptions == preemptions:  # admitting right after evicting would only evict again (L5)
            self.admit()
        return self.plan

    # Task L8.2: admission under the budget: the cache hit first, the first slice sized from what is left
    def slice_size(self, remaining: int) -> int:
        n = min(remaining, self.budget)
        return n if self.slice_cap is None else min(n, self.slice_cap)

    def is_long(self, seq: SharedSequence, cached: int) -> bool:
        return self.long_prefill_threshold is not None and seq.num_tokens - cached > self.long_prefill_threshold

    # Task L8.2: admission under the budget: the cache hit first, the first slice sized from what is left
    def take(self, piece: Slice) -> None:
        piece.seq.extra["fed_at"] = self.step_no
        self.budget -= piece.num_tokens - piece.num_cached
        self.plan.append(piece)

    # Task L8.3: blocks for a slice's end, preempting the youngest; an evicted request's slice refunds the budget
    def reserve(self, seq: SharedSequence, upto: int) -> bool:
        """Blocks for tokens 0 .. upto-1, preempting the youngest running requests until they fit. False if
        `seq` is itself the youngest and had to yield."""
        while True:
            try:
                seq.reserve(upto, self.allocator)
                return True
            except PoolExhausted:
                victim = self.running[-1]  # running is in arrival order: the last is the youngest
                if victim is seq and len(self.running) == 1:  # alone with the whole pool: waiting cannot help
                    raise CourseError(f"request {seq.seq_id} needs {blocks_for(upto, self.block_size)} blocks "
                                      f"alone and the pool has {self.allocator.num_blocks}")
                self.evict(victim)
                if victim is seq:
                    return False

    # Task L8.3: blocks for a slice's end, preempting the youngest; an evicted request's slice refunds the budget
    def evict(self, seq: SharedSequence) -> None:
        for piece in [p for p in self.plan if p.seq is seq]:
            self.plan.remove(piece)
            self.budget += piece.num_tokens - piece.num_cached  # its tokens go back to the step
        self.running.remove(seq)
        self.preempt(seq)  # L6: references returned, num_cached 0, front of the waiting queue

    # Task L8.2: admission under the budget: the cache hit first, the first slice sized from what is left
    def admit(self) -> None:
        """L6's admission with a budget: the cache hit is applied first, then the first slice is sized from
        what is left (so a hit shortens the slice), and only that slice's blocks are allocated."""
        inflight = self.inflight_keys() if self.wait_for_inflight else set()
        long_prefills = sum(self.is_long(s, s.num_cached) for s in self.running)  # before this step's slices
        for seq in list(self.waiting):
            if len(self.running) >= self.max_running or self.budget == 0:
                return
            hits = self.match(seq)
            # Its next block is being computed by a running request (in this step or a later slice of its
            # prompt): it waits, and hits it once it is written, instead of computing it a second time.
            if self.waits_for(seq, hits, inflight):
                continue
            cached = len(hits) * self.block_size  # at most num_tokens - 1: a full hit still computes a token
            long = self.is_long(seq, cached)
            if long and self.max_long_prefills is not None and long_prefills >= self.max_long_prefills:
                continue  # K long prompts are part-way through: shorter ones behind it go first
            n = self.slice_size(seq.num_tokens - cached)
            fresh = blocks_for(cached + n, self.block_size) - len(hits)
            if fresh + self.revived(hits) > self.allocator.num_free:
                return  # head of line for memory: nothing younger overtakes it, or it could starve
            self.waiting.remove(seq)
            self.allocator.share(hits)  # first: alloc below must not evict the blocks just hit
            seq.blocks = hits + self.allocator.alloc(fresh)
            seq.num_cached = cached
            seq.extra["registered"], seq.extra["chain"] = len(hits), self.cache.ident(hits[-1]) if hits else None
            self.stats.prompt_tokens += seq.num_tokens
            self.stats.cached_tokens += cached
            self.stats.prefill_tokens += seq.num_tokens - cached
            self._run(seq)
            self.take(Slice.of(seq, n))
            long_prefills += long
            if self.wait_for_inflight:
                inflight |= self.pending_keys(seq)  # every block of its prompt this step or a later one fills

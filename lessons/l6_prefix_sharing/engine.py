"""L6's engine: L5's (recompute only) on a ref-counted block manager with a prefix cache, and n > 1."""
from __future__ import annotations

from lessons.l4_continuous.sampling import SamplingParams, check_seed, sample
from lessons.l5_preemption.engine import L5Engine
from lessons.l6_prefix_sharing.block_manager import RefBlockManager
from lessons.l6_prefix_sharing.prefix_cache import HashFn, PrefixCache, default_hash
from lessons.l6_prefix_sharing.scheduler import PrefixScheduler
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l6_prefix_sharing.stats import PrefixStats
from shared.errors import CourseError
from shared.generation import StopRule


class L6Engine(L5Engine):
    block_manager_class: type[RefBlockManager] = RefBlockManager  # L10 swaps in one that defers its copies

    def __init__(self, *args, policy: str = "recompute", hash_fn: HashFn = default_hash, wait_for_inflight: bool = True,
                 **kwargs):
        if policy == "swap":
            raise CourseError("--policy swap is not supported in L6: shared blocks would need ref-counted host "
                              "blocks; use recompute (a re-prefill hits the cache)")
        if policy != "recompute":
            raise CourseError(f"unknown preemption policy {policy!r}: use recompute")
        self.hash_fn, self.wait_for_inflight = hash_fn, wait_for_inflight
        super().__init__(*args, policy=policy, **kwargs)

    def make_scheduler(self, max_running: int) -> PrefixScheduler:
        # Called by L4's __init__ once the runner exists: the runner only holds its allocator, so the
        # ref-counted manager takes its place (same alloc / free / num_free / num_blocks).
        self.stats = PrefixStats()
        self.cache = PrefixCache(self.hash_fn)
        self.allocator = self.runner.allocator = self.block_manager_class(self.runner.allocator.num_blocks, self.cache,
                                                                            self.stats, self.runner.pool)
        return PrefixScheduler(self.allocator, self.block_size, max_running, self.stats, self.wait_for_inflight)

    def add_request(self, prompt_ids: list[int], stop: StopRule, sampling: SamplingParams = SamplingParams(),
                    n: int = 1) -> SharedSequence:
        """As L4's; with n > 1 returns the first of the n sequences (add_parallel returns them all)."""
        return self.add_parallel(prompt_ids, stop, sampling, n)[0]

    def add_parallel(self, prompt_ids: list[int], stop: StopRule, sampling: SamplingParams = SamplingParams(),
                     n: int = 1) -> list[SharedSequence]:
        """n samples of one prompt: prefilled once, then forked. Child i samples with seed + i, so it gives
        what the prompt alone with that seed gives. Bad input raises CourseError with nothing changed."""
        check_n(n, sampling)
        self.check_request(prompt_ids, stop, sampling)
        seqs = [SharedSequence(list(prompt_ids), self.block_size, seq_id=self._next_id + i, arrival=self.clock,
                               stop=stop, sampling=sampling) for i in range(n)]
        for i, seq in enumerate(seqs):
            if not sampling.greedy:
                seq.generator = self.generator_for(seq.seq_id, None if sampling.seed is None else sampling.seed + i)
        self.scheduler.add(seqs[0])  # the size check; the siblings are the same size
        seqs[0].extra["forks"] = seqs[1:]
        self._next_id += n
        return seqs

    # Task L6.7: parallel sampling: fork siblings onto the parent blocks; the step samples them from its row
    def step(self) -> list[SharedSequence]:
        """L4's step, plus: register what the forward wrote, then fork the siblings of fresh prefills."""
        self.clock += 1
        batch = self.scheduler.schedule()
        if not batch:
            return []
        logits = self.runner.forward(batch)
        self.stats.record(batch, self.allocator.num_blocks - self.allocator.num_free, self.block_size)
        self.scheduler.register_written(batch)
        rows = list(range(len(batch)))
        for i, seq in enumerate(list(batch)):
            children = self.scheduler.fork(seq)
            batch += children
            rows += [i] * len(children)  # each child samples its first token from the shared prefill's logits
        if len(rows) > len(logits):
            logits = logits[rows]
        tokens = sample(logits, [s.sampling for s in batch], [s.generator for s in batch])
        return self.scheduler.postprocess(batch, tokens)


def check_n(n: object, sampling: SamplingParams) -> None:
    """Greedy n > 1 is refused: n identical copies is never what a caller meant, and silently giving them
    would hide a forgotten temperature."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CourseError(f"n must be at least 1, got {n!r}")
    if n > 1 and sampling.greedy:
        raise CourseError(f"n = {n} with greedy sampling would give {n} identical outputs: set a temperature > 0")
    if n > 1 and sampling.seed is not None:
        check_seed(sampling.seed + n - 1, "seed + n - 1 (the last child's seed)")

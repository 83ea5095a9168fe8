"""L8's engine: L7's, with one token budget per step. Decode rows and prompt slices run in one forward."""
from __future__ import annotations

import time
from typing import Callable

from lessons.l4_continuous.sampling import SamplingParams, sample
from lessons.l6_prefix_sharing.scheduler import PrefixScheduler
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l7_cuda_graphs.engine import L7Engine
from lessons.l8_chunked_prefill.runner import ChunkedRunner
from lessons.l8_chunked_prefill.scheduler import (DEFAULT_MAX_BATCHED_TOKENS, ChunkedScheduler, check_budget,
                                                  check_long_prefills)
from lessons.l8_chunked_prefill.timing import RequestTiming
from shared.generation import StopRule


class L8Engine(L7Engine):
    runner_class = ChunkedRunner

    def __init__(self, *args, max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
                 max_slice_tokens: int | None = None, max_long_prefills: int | None = None,
                 long_prefill_threshold: int | None = None, timer: Callable[[], float] = time.perf_counter, **kwargs):
        check_budget(max_batched_tokens, "max-batched-tokens")  # before the pool and the graphs are built
        check_budget(max_slice_tokens, "max-slice-tokens", allow_none=True)
        check_long_prefills(max_long_prefills, long_prefill_threshold)
        self.max_batched_tokens, self.max_slice_tokens, self.timer = max_batched_tokens, max_slice_tokens, timer
        self.max_long_prefills, self.long_prefill_threshold = max_long_prefills, long_prefill_threshold
        self.timing: dict[int, RequestTiming] = {}  # seq_id -> when it arrived and when each token came
        self.prompt_slices: dict[int, int] = {}  # seq_id -> steps that computed part of its prompt
        self.step_tokens: list[int] = []  # per step: tokens computed (never above the budget)
        super().__init__(*args, **kwargs)

    def make_scheduler(self, max_running: int) -> PrefixScheduler:
        super().make_scheduler(max_running)  # L6's builds the stats, the prefix cache and the ref-counted manager
        return ChunkedScheduler(self.allocator, self.block_size, max_running, self.stats, self.wait_for_inflight,
                                self.max_batched_tokens, self.max_slice_tokens, self.max_long_prefills,
                                self.long_prefill_threshold)

    def add_parallel(self, prompt_ids: list[int], stop: StopRule, sampling: SamplingParams = SamplingParams(),
                     n: int = 1) -> list[SharedSequence]:
        seqs = super().add_parallel(prompt_ids, stop, sampling, n)
        now = self.timer()
        for seq in seqs:
            self.timing[seq.seq_id] = RequestTiming(self.clock, now)
        return seqs

    # Task L8.6: the step: plan, one forward, each slice's computed count back to its request, sample where it ends
    def step(self) -> list[SharedSequence]:
        """Schedule slices -> one forward over all of them -> sample the requests whose slice reached their end."""
        self.clock += 1
        plan = self.scheduler.schedule()
        if not plan:
            return []
        self.step_tokens.append(sum(piece.num_tokens - piece.num_cached for piece in plan))
        logits = self.runner.forward(plan)  # [slices that sample, vocab]; sets each slice's num_cached
        batch = [piece.seq for piece in plan]
        for piece in plan:
            piece.seq.num_cached = piece.num_cached  # the slice's computed count is the request's now
            if not piece.decode:
                self.prompt_slices[piece.seq_id] = self.prompt_slices.get(piece.seq_id, 0) + 1
        self.stats.record(batch, self.allocator.num_blocks - self.allocator.num_free, self.block_size)
        self.scheduler.register_written(batch)  # a block is cacheable once the slice that fills it has run
        sampled = [piece.seq for piece in plan if piece.samples]
        rows = list(range(len(sampled)))
        for i, seq in enumerate(list(sampled)):
            children = self.scheduler.fork(seq)  # n > 1: only once the prompt is complete
            sampled += children
            rows += [i] * len(children)  # each child samples its first token from the parent's last row
        if len(rows) > len(logits):
            logits = logits[rows]
        tokens = sample(logits, [s.sampling for s in sampled], [s.generator for s in sampled]) if sampled else []
        finished = self.scheduler.postprocess(sampled, tokens)
        now = self.timer()
        for seq in sampled:
            self.timing[seq.seq_id].stamp(self.clock, now)
        return finished

"""L4's engine: requests arrive over time; every step is schedule -> one ragged forward -> sample -> retire."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lessons.l2_token_flat.engine import pool_blocks
from lessons.l3_block_tensor.runner import PagedRunner
from lessons.l4_continuous.sampling import SEED_LIMIT, SamplingParams, check_seed, sample
from lessons.l4_continuous.scheduler import Scheduler
from lessons.l4_continuous.sequence import Sequence
from lessons.l4_continuous.stats import EngineStats
from shared.errors import CourseError
from shared.generation import StopRule, check_prompt
from shared.model import Qwen3ForCausalLM

DEFAULT_MAX_RUNNING = 64
SEED_STRIDE = 1_000_003  # an unseeded request samples with (engine seed * SEED_STRIDE + request id) mod 2**64


@dataclass(frozen=True)
class Arrival:
    """One request of a workload: what to run, and at which engine step it is submitted."""

    prompt_ids: list[int]
    stop: StopRule
    sampling: SamplingParams = SamplingParams()
    step: int = 0


class L4Engine:
    def __init__(self, model: Qwen3ForCausalLM, block_size: int = 16, num_blocks: int | None = None,
                 max_running: int = DEFAULT_MAX_RUNNING, backend: str = "auto", seed: int = 0,
                 runner: PagedRunner | None = None):
        check_seed(seed, "engine seed")
        num_blocks = pool_blocks(block_size, num_blocks)
        self.model, self.block_size, self.seed = model, block_size, seed
        # `runner` lets tests drive the scheduler with a fake model; normally it is L3's paged runner.
        self.runner = runner or PagedRunner(model, block_size, num_blocks, backend=backend)
        self.allocator = self.runner.allocator
        self.stats = EngineStats()
        self.scheduler = self.make_scheduler(max_running)
        self.clock = 0  # engine steps so far; arrivals are measured in it
        self._next_id = 0

    def make_scheduler(self, max_running: int) -> Scheduler:
        return Scheduler(self.allocator, self.block_size, max_running)

    def add_request(self, prompt_ids: list[int], stop: StopRule, sampling: SamplingParams = SamplingParams()) -> Sequence:
        """Validate and queue. Bad input raises CourseError and leaves the engine exactly as it was."""
        self.check_request(prompt_ids, stop, sampling)
        seq = Sequence(list(prompt_ids), self.block_size, seq_id=self._next_id, arrival=self.clock,
                       stop=stop, sampling=sampling)
        if not sampling.greedy:  # before queueing: no queued sampled request is ever without its generator
            seq.generator = self.generator_for(seq.seq_id, sampling.seed)
        self.scheduler.add(seq)  # the last check: a request larger than the whole pool; changes nothing
        self._next_id += 1
        return seq

    def check_request(self, prompt_ids: list[int], stop: StopRule, sampling: SamplingParams) -> None:
        check_prompt(prompt_ids, stop, self.model.config)
        check_token_ids(prompt_ids, sampling.stop_token_ids, self.model.config.vocab_size)

    def generator_for(self, seq_id: int, seed: int | None) -> torch.Generator:
        """A sampled request's own RNG: its seed, or one derived from the engine's seed and its id."""
        if seed is None:
            seed = (self.seed * SEED_STRIDE + seq_id) % SEED_LIMIT
        return torch.Generator(device=self.runner_device).manual_seed(seed)

    @property
    def runner_device(self) -> torch.device:
        return self.model.lm_head.weight.device

    # Task L4.7: the engine step: schedule -> one ragged forward -> sample -> postprocess; arrivals on the clock
    def step(self) -> list[Sequence]:
        """One engine step; returns the requests that finished in it."""
        self.clock += 1
        batch = self.scheduler.schedule()
        if not batch:
            return []
        logits = self.runner.forward(batch)  # [B, vocab] fp32; advances each num_cached
        self.stats.record(batch, self.allocator.num_blocks - self.allocator.num_free, self.block_size)
        tokens = sample(logits, [s.sampling for s in batch], [s.generator for s in batch])
        return self.scheduler.postprocess(batch, tokens)

    # Task L4.7: the engine step: schedule -> one ragged forward -> sample -> postprocess; arrivals on the clock
    def run(self, workload: list[Arrival]) -> list[list[int]]:
        """Submit each request when the clock reaches its step; step until all finish. Outputs in input order."""
        order = sorted(range(len(workload)), key=lambda i: workload[i].step)
        seqs: dict[int, Sequence] = {}
        k = 0
        while k < len(order) or self.scheduler.has_work():
            if not self.scheduler.has_work() and k < len(order):
                self.clock = max(self.clock, workload[order[k]].step)  # idle: jump to the next arrival
            while k < len(order) and workload[order[k]].step <= self.clock:
                a = workload[order[k]]
                seqs[order[k]] = self.add_request(a.prompt_ids, a.stop, a.sampling)
                k += 1
            self.step()
        return [seqs[i].output_ids for i in range(len(workload))]

    def generate_batch(self, prompts: list[list[int]], stop: StopRule, sampling: SamplingParams = SamplingParams(),
                       stagger: int = 0) -> list[list[int]]:
        """Request i arrives at step stagger * i (0: all at once)."""
        return self.run([Arrival(p, stop, sampling, stagger * i) for i, p in enumerate(prompts)])


def check_token_ids(prompt_ids: list[int], stop_token_ids: frozenset[int], vocab_size: int) -> None:
    """An id outside the vocabulary would fail inside every later forward, taking the whole batch with it;
    a stop id outside it could never match, so it is refused as the typo it most likely is."""
    for what, ids in (("prompt", prompt_ids), ("stop", stop_token_ids)):
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise CourseError(f"{what} token id {token!r} is outside the vocabulary (vocab size {vocab_size})")

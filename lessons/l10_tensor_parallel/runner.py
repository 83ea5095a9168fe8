"""L8's runner on every rank. Rank 0's tells the others what to do, then does it; theirs just do it.

Each call that builds or runs something (the runner itself, the graph capture, a step) is first sent
to the followers (`lead`), so every rank makes the same calls in the same order: the same block ids,
the same padded sizes, the same collectives. A step travels as its slices, trimmed to what a follower
needs (wire.py: their numbers, new tokens, and the block-table entries the follower's copy lacks, see
tables.py), plus the copy-on-write copies the scheduler made since the last step.
"""
from __future__ import annotations

import torch

from lessons.l2_token_flat.request import Request
from lessons.l8_chunked_prefill.runner import ChunkedRunner
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM
from lessons.l10_tensor_parallel.tables import KeptTables, SentTables
from lessons.l10_tensor_parallel.wire import SentSlice


def runner_factory(make):
    """Marks a function that makes a runner class from plain strings (a subclass made at run time names one in
    its `recipe`): the only kind of function a follower calls to build its runner (follower.py)."""
    make.makes_tp_runner = True
    return make


class TpRunner(ChunkedRunner):
    @classmethod
    def recipe(cls) -> list[str]:
        """What the followers build (follower.py's runner_class): this class's "module:name", sent as data. A
        subclass made at run time returns a runner_factory's "module:name" and the strings to call it with."""
        return [f"{cls.__module__}:{cls.__qualname__}"]

    def __init__(self, model: TpQwen3ForCausalLM, block_size: int, num_blocks: int, backend: str = "auto"):
        self.tp = model.tp
        self.sent_tables, self.kept_tables = SentTables(), KeptTables()  # rank 0 uses the first, followers the second
        with self.tp.lead("build_runner", block_size, num_blocks, backend, *self.recipe()):
            super().__init__(model, block_size, num_blocks, backend)  # a pool of this rank's KV heads only

    def capture(self, sizes: list[int], dummy_block: int) -> None:
        with self.tp.lead("capture", sizes, dummy_block):
            super().capture(sizes, dummy_block)

    # Task L10.7: rank 0 sends each step, its deferred copies too; every rank runs it
    def forward(self, slices: list[Slice]) -> torch.Tensor:
        """Rank 0, from the engine's step: send the step, then run it. Logits [slices that sample, vocab]."""
        copies = self.allocator.take_copies()  # the ref-counted manager's copy-on-write, not yet made
        starts = self.sent_tables.starts(slices)  # per slice, the first table entry the followers lack
        with self.tp.lead("run_step", slices, copies, starts):  # close() waits for the step's collectives to end
            return self.run_step(slices, copies)

    # Task L10.7: rank 0 sends each step, its deferred copies too; every rank runs it
    def follow_step(self, slices: list[SentSlice], copies: list[tuple[int, int]]) -> None:
        """A follower: rank 0's step, each slice's table joined to this rank's copy first."""
        self.run_step(self.kept_tables.join(slices), copies)

    # Task L10.7: rank 0 sends each step, its deferred copies too; every rank runs it
    def run_step(self, slices: list[Request], copies: list[tuple[int, int]]) -> torch.Tensor | None:
        """Every rank: the deferred copies first (this step may write into a copy), then L8's step."""
        for src, dst in copies:
            for rows in self.pool.k + self.pool.v:
                rows[dst].copy_(rows[src])
        return super().forward(slices)

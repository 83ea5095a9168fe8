"""A request as the scheduler sees it: L2's Request (tokens, block table) plus arrival, sampling and state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from lessons.l2_token_flat.engine import blocks_for
from lessons.l2_token_flat.request import Request
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.table_tensor import TableTensor
from shared.generation import StopRule


class Status(enum.Enum):
    WAITING = "waiting"  # submitted, holds no blocks
    RUNNING = "running"  # admitted, holds blocks, fed every step
    SWAPPED = "swapped"  # (L5) its KV lives in host memory, holds no device blocks
    FINISHED = "finished"  # retired, blocks returned


@dataclass(eq=False)  # keep Request's identity equality (eq=True here would compare fields again)
class Sequence(Request):
    seq_id: int = 0
    arrival: int = 0  # engine step at which it was submitted
    stop: StopRule = StopRule(20)
    sampling: SamplingParams = SamplingParams()
    generator: torch.Generator | None = None  # this request's own RNG (None when greedy)
    status: Status = Status.WAITING
    admitted_at: int = -1  # step of the latest admission: L5 preempts the most recent one
    finished_at: int = -1
    extra: dict = field(default_factory=dict)  # lesson-specific bookkeeping (L5: host blocks)
    table: TableTensor = field(default_factory=TableTensor, repr=False)  # the block table as int32, kept

    def block_table_tensor(self, n: int) -> torch.Tensor:
        # A running request is stepped thousands of times: its table tensor grows by appending, not afresh.
        return self.table.first(self.blocks, n)

    # Task L4.2: the most blocks a request can hold (prompt + max_new - 1 tokens fed); finished on stop rule or stop id
    @property
    def max_tokens_fed(self) -> int:
        """The most tokens ever fed: the last generated token is sampled, never cached."""
        return len(self.prompt_ids) + self.stop.max_new_tokens - 1

    # Task L4.2: the most blocks a request can hold (prompt + max_new - 1 tokens fed); finished on stop rule or stop id
    @property
    def max_blocks(self) -> int:
        return blocks_for(self.max_tokens_fed, self.block_size)

    # Task L4.2: the most blocks a request can hold (prompt + max_new - 1 tokens fed); finished on stop rule or stop id
    def is_finished(self) -> bool:
        if self.stop.is_done(self.output_ids):
            return True
        return bool(self.output_ids) and self.output_ids[-1] in self.sampling.stop_token_ids

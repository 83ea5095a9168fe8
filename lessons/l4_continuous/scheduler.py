"""The continuous-batching scheduler: every step admit what fits, run everything running, retire what finished.

Without preemption (that is L5) a running request must never find the pool empty when it needs its next
block. So admission is a promise: a request is admitted only if the blocks it could ever need
(`max_blocks`), added to the promises already made to the running requests, fit in the pool. Blocks are
still *allocated* lazily, one at a time as each request grows, so the pool holds little waste; the
promise only limits how many requests run together. Everything here is Python ints and lists.
"""
from __future__ import annotations

from collections import deque

from lessons.l2_token_flat.block_allocator import BlockAllocator
from lessons.l4_continuous.sequence import Sequence, Status
from shared.errors import CourseError


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_running: int):
        if max_running < 1:
            raise CourseError(f"max-running must be at least 1, got {max_running}")
        self.allocator, self.block_size, self.max_running = allocator, block_size, max_running
        self.capacity = allocator.num_blocks  # the most blocks requests can ever hold (L7 keeps one back)
        self.waiting: deque[Sequence] = deque()  # FIFO: the head blocks the line until it fits
        self.running: list[Sequence] = []  # admission order: the last one is the most recently admitted
        self.step_no = 0

    def add(self, seq: Sequence) -> None:
        """Queue a request; refuse at once one the whole pool could never hold (nothing is changed then)."""
        if seq.max_blocks > self.capacity:
            raise CourseError(
                f"request {seq.seq_id}: prompt ({len(seq.prompt_ids)} tokens) + max-new-tokens "
                f"({seq.stop.max_new_tokens}) needs {seq.max_blocks} blocks of {self.block_size} tokens; "
                f"the whole pool has {self.capacity}"
            )
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step: schedule -> (the engine runs the model and samples) -> postprocess ---

    # Task L4.4: a step's batch: reserve, admit; then append each token, retire the finished at once
    def schedule(self) -> list[Sequence]:
        """Reserve this step's blocks for every running request, admit new ones; return the batch."""
        self.step_no += 1
        for seq in self.running:
            seq.reserve(seq.num_tokens, self.allocator)  # cannot fail: promised at admission
        self.admit()
        return list(self.running)

    # Task L4.3: admission is a promise: FIFO while every max_blocks promised fits the pool
    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running and self.can_admit(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.reserve(seq.num_tokens, self.allocator)  # the whole prompt's blocks, all or nothing
            seq.status, seq.admitted_at = Status.RUNNING, self.step_no
            self.running.append(seq)

    # Task L4.3: admission is a promise: FIFO while every max_blocks promised fits the pool
    def can_admit(self, seq: Sequence) -> bool:
        promised = sum(s.max_blocks for s in self.running)
        return promised + seq.max_blocks <= self.allocator.num_blocks

    # Task L4.4: a step's batch: reserve, admit; then append each token, retire the finished at once
    def postprocess(self, batch: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each request's new token; retire the finished ones at once, returning their blocks."""
        finished = []
        for seq, token in zip(batch, tokens):
            seq.output_ids.append(token)
            if seq.is_finished():
                self.retire(seq)
                finished.append(seq)
        return finished

    # Task L4.4: a step's batch: reserve, admit; then append each token, retire the finished at once
    def retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.blocks)
        seq.blocks = []
        seq.status, seq.finished_at = Status.FINISHED, self.step_no

"""L5's scheduler: admit on what a request needs now, and preempt when a running request cannot grow.

L4 admitted a request only if the blocks it could *ever* need were promised, so decode never stalled,
but most of those promised blocks sit unused most of the time. L5 admits on the blocks a request needs
*now* (its prompt) and pays when the pool runs dry mid-decode: the most recently admitted request is
preempted, by one of two policies:
  recompute - free its blocks, put it at the head of the waiting queue; on readmission its prompt plus
              the tokens it already generated are prefilled again (compute traded for memory);
  swap      - copy its blocks to host memory, free them; copy them back into fresh blocks later
              (PCIe traffic traded for compute). Falls back to recompute when host space runs out.
"""
from __future__ import annotations

from collections import deque

from lessons.l2_token_flat.block_allocator import BlockAllocator
from lessons.l2_token_flat.engine import blocks_for
from lessons.l4_continuous.scheduler import Scheduler
from lessons.l4_continuous.sequence import Sequence, Status
from lessons.l4_continuous.stats import EngineStats
from lessons.l5_preemption.host_pool import HostKvPool
from shared.errors import CourseError, PoolExhausted

POLICIES = ("recompute", "swap")


class PreemptingScheduler(Scheduler):
    def __init__(self, allocator: BlockAllocator, block_size: int, max_running: int, policy: str,
                 host: HostKvPool | None, stats: EngineStats):
        super().__init__(allocator, block_size, max_running)
        if policy not in POLICIES:
            raise CourseError(f"unknown preemption policy {policy!r}: use recompute or swap")
        self.policy, self.host, self.stats = policy, host, stats
        self.swapped: deque[Sequence] = deque()  # their KV is on the host; readmitted before `waiting`

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> list[Sequence]:
        self.step_no += 1
        todo, kept = deque(self.running), []
        while todo:
            seq = todo.popleft()
            while True:
                try:
                    seq.reserve(seq.num_tokens, self.allocator)
                    kept.append(seq)
                    break
                except PoolExhausted:
                    if todo:  # evict the most recently admitted one still unplaced, then retry
                        self.preempt(todo.pop())
                    elif kept:  # seq itself is now the most recent: it yields to the older ones
                        self.preempt(seq)
                        break
                    else:  # alone with the whole pool and still no room: waiting would hang forever
                        raise CourseError(
                            f"request {seq.seq_id} needs {blocks_for(seq.num_tokens, self.block_size)} blocks "
                            f"alone and the pool has {self.allocator.num_blocks}"
                        )
        preempted = len(kept) < len(self.running)
        self.running = kept
        if not preempted:  # admitting right after evicting would only evict again next step
            self.admit()
        return list(self.running)

    def admit(self) -> None:
        """Swapped requests first (they were running before anything waiting), then waiting, both FIFO."""
        while self.swapped and len(self.running) < self.max_running and self.fits_now(self.swapped[0]):
            seq = self.swapped.popleft()
            seq.reserve(seq.num_tokens, self.allocator)
            self.host.swap_in(seq.extra.pop("host_blocks"), seq.blocks)
            self.stats.swaps_in += 1
            self._run(seq)
        if self.swapped:
            return  # keep the order: nothing overtakes a request that was already running
        while self.waiting and len(self.running) < self.max_running and self.fits_now(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.reserve(seq.num_tokens, self.allocator)
            self._run(seq)

    def fits_now(self, seq: Sequence) -> bool:
        return blocks_for(seq.num_tokens, self.block_size) - len(seq.blocks) <= self.allocator.num_free

    def _run(self, seq: Sequence) -> None:
        seq.status, seq.admitted_at = Status.RUNNING, self.step_no
        self.running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        self.stats.preemptions += 1
        used = seq.blocks[: blocks_for(seq.num_cached, self.block_size)]  # blocks reserved ahead hold nothing
        if self.policy == "swap" and self.host is not None and self.host.can_hold(len(used)):
            seq.extra["host_blocks"] = self.host.swap_out(used)
            self.stats.swaps_out += 1
            seq.status = Status.SWAPPED
            self.swapped.appendleft(seq)  # preempted newest-first, so the oldest ends up at the front
        else:
            seq.num_cached = 0  # its KV is dropped: everything is prefilled again on readmission
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
        self.allocator.free(seq.blocks)
        seq.blocks = []

"""L5's scheduler: admit on what a request needs now, and preempt when a running request cannot grow.

L4 admitted a request only if the blocks it could *ever* need were promised, so decode never stalled,
but most of those promised blocks sit unused most of the time. L5 admits on the blocks a request needs
*now* (its prompt) and pays when the pool runs dry mid-decode: the running request that arrived last
(highest seq_id, given in submission order) is preempted, by one of two policies:
  recompute - free its blocks, put it at the head of the waiting queue; on readmission its prompt plus
              the tokens it already generated are prefilled again (compute traded for memory);
  swap      - copy its blocks to host memory, free them; copy them back into fresh blocks later
              (PCIe traffic traded for compute). Falls back to recompute when host space runs out.
Order is arrival order across both queues: admission takes the older of the heads of `swapped` and
`waiting`, and if it does not fit nothing younger goes ahead. So every running request arrived before
every queued one, `running` stays sorted by arrival, and its last entry is always the victim.
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
        self.swapped: deque[Sequence] = deque()  # their KV is on the host; arrival order, like `waiting`

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # Task L5.4: grow every running request; when the pool is dry preempt the newest, admit only if none was
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
                    if todo:  # evict the last-arrived one still unplaced, then retry
                        self.preempt(todo.pop())
                    elif kept:  # seq itself arrived last of those left: it yields to the older ones
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

    # Task L5.3: admit on current need, the older of the two queue heads first (swap it back in); head of line
    def admit(self) -> None:
        """Oldest arrival first across both queues: swap in a swapped one, prefill a waiting one."""
        while len(self.running) < self.max_running:
            heads = [queue for queue in (self.swapped, self.waiting) if queue]
            if not heads:
                return
            queue = min(heads, key=lambda q: q[0].seq_id)
            seq = queue[0]
            if not self.fits_now(seq):
                return  # head of line: nothing younger overtakes it, or the oldest could starve
            queue.popleft()
            seq.reserve(seq.num_tokens, self.allocator)
            if queue is self.swapped:
                self.host.swap_in(seq.extra.pop("host_blocks"), seq.blocks)
                self.stats.swaps_in += 1
            self._run(seq)

    # Task L5.3: admit on current need, the older of the two queue heads first (swap it back in); head of line
    def fits_now(self, seq: Sequence) -> bool:
        return blocks_for(seq.num_tokens, self.block_size) - len(seq.blocks) <= self.allocator.num_free

    def _run(self, seq: Sequence) -> None:
        seq.status, seq.admitted_at = Status.RUNNING, self.step_no
        self.running.append(seq)  # it arrived after every running one, so `running` stays in arrival order

    # Task L5.2: preempt: swap the blocks in use to host if it has room, else drop the KV; front of its queue
    def preempt(self, seq: Sequence) -> None:
        self.stats.preemptions += 1
        used = seq.blocks[: blocks_for(seq.num_cached, self.block_size)]  # blocks reserved ahead hold nothing
        if self.policy == "swap" and self.host is not None and self.host.can_hold(len(used)):
            seq.extra["host_blocks"] = self.host.swap_out(used)
            self.stats.swaps_out += 1
            seq.status = Status.SWAPPED
            self.swapped.appendleft(seq)  # it arrived before every queued request: the front keeps order
        else:
            seq.num_cached = 0  # its KV is dropped: everything is prefilled again on readmission
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)  # same reason: the front keeps arrival order
        self.allocator.free(seq.blocks)
        seq.blocks = []

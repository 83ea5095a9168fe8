"""The ranks of one tensor-parallel engine, and everything they say to each other.

Two process groups over the same ranks:
  compute  the model's collectives: one all-reduce after each row-parallel matmul, the LM head's gather.
           NCCL on CUDA, gloo on CPU. Bounded by the timeout: inside a step every rank runs the same
           forward, so a wait that long means a rank died or hung.
  control  rank 0's instructions to the others (load this model, build this runner, run this step, stop):
           pickled Python objects, so always gloo, on the host. Rank 0's sends are bounded by the same
           timeout; a follower's wait is unbounded in practice: between steps it waits for as long as the
           server has nothing to do.
A rank that exits closes its sockets, so the others' next collective fails at once, not at the timeout.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shared.errors import RunFailure

DEFAULT_TIMEOUT_S = 60.0
IDLE_TIMEOUT = timedelta(days=365)  # a follower waiting for rank 0's next step: as long as the server idles


@dataclass
class TpGroup:
    rank: int
    size: int
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S
    compute: Any = None  # torch.distributed ProcessGroup (None when size is 1: nothing to talk to)
    control: Any = None
    on_close: list = field(default_factory=list)  # rank 0: what close() also does (join the follower processes)
    calls: Counter = field(default_factory=Counter)  # collective -> times this rank made it
    seconds: Counter = field(default_factory=Counter)  # collective -> seconds this rank spent in it (waits included)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place: each held a partial sum of the same output."""
        if self.size > 1:
            self._collective("all-reduce", dist.all_reduce, x, group=self.compute)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's x joined along the last dim, in rank order; the others get None."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.leader else None
        self._collective("gather", dist.gather, x.contiguous(), parts, dst=0, group=self.compute)
        return torch.cat(parts, dim=-1) if self.leader else None

    def lead(self, *message: Any) -> None:
        """Rank 0: send every follower the call it is about to make itself. Elsewhere: nothing (they are
        making this call because rank 0's message told them to)."""
        if self.leader and self.size > 1:
            self._collective("broadcast", dist.broadcast_object_list, [message], src=0, group=self.control)

    def receive(self) -> tuple | None:
        """A follower: wait for rank 0's next message (None: stop)."""
        box: list[Any] = [None]
        self._collective("receive", dist.broadcast_object_list, box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        """Rank 0: tell the followers to stop (if they can still hear it), then release everything."""
        if self.leader and self.size > 1 and self.control is not None:
            try:
                dist.broadcast_object_list([None], src=0, group=self.control)
            except RuntimeError:
                pass  # a follower is gone already; on_close ends the rest
        if self.compute is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.compute = self.control = None
        for action in self.on_close:
            action()
        self.on_close.clear()

    def _collective(self, what: str, fn, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args, **kwargs)
        except RuntimeError as e:  # gloo and NCCL report a lost peer and a timeout alike, as RuntimeError
            raise RunFailure(f"tensor-parallel rank {self.rank} of {self.size}: {what} failed ({_reason(e)}); "
                             f"another rank exited or hung longer than the {self.timeout_s:g} s timeout") from None
        self.calls[what] += 1
        self.seconds[what] += time.perf_counter() - t0


def _reason(e: Exception) -> str:
    """gloo's message without its source location and its advice: "Connection closed by peer [...]"."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0].rstrip(".")

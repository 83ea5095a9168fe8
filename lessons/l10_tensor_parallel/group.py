"""The ranks of one tensor-parallel engine, and everything they say to each other.

Two process groups over the same ranks:
  compute  the model's collectives: one all-reduce after each row-parallel matmul, the LM head's gather.
           NCCL on CUDA, gloo on CPU. Bounded by the timeout: inside a step every rank runs the same
           forward, so a wait that long means a rank died or hung.
  control  rank 0's instructions to the others (load this model, build this runner, run this step, stop),
           and once the engine's limits, which bound the length of every message after them:
           int64 tensors in a fixed schema (wire.py), never pickle, so always gloo, on the host. Rank 0's
           send of a step is bounded by the same timeout, its sends while the ranks start (load, build the
           runner, capture) by STARTUP_TIMEOUT_S: a follower still loading its part has not hung. A
           follower's wait is unbounded in practice: between steps it waits as long as the server idles.
Every collective is issued with async_op=True and waited for with the timeout (Work.wait(timeout)): gloo
enforces its group timeout itself, NCCL does not (a CUDA collective returns before it ran), so this wait is
what bounds a step on both. A rank that exits closes its sockets, so the others' next collective fails at
once, not at the timeout.

Rank 0 holds a lock for each call it leads (a step: its send and its collectives), and close() takes it:
the engine thread may still be in a step when the server shuts down, and two collectives at once on the
same ranks would interleave their messages.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from lessons.l10_tensor_parallel import wire
from shared.errors import RunFailure

DEFAULT_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 120.0  # a fresh interpreter imports torch and loads its part: seconds, more on a busy machine
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
    closed: bool = False
    failure: str | None = None  # the first collective that failed: the ranks are out of step from there on
    limits: wire.Limits = field(default_factory=wire.Limits)  # a follower: what bounds the next message's length
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # rank 0: held by a call it leads

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place: each held a partial sum of the same output."""
        if self.size > 1:
            self._collective("all-reduce", dist.all_reduce, x, group=self.compute, wait_s=self.timeout_s)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's x joined along the last dim, in rank order; the others get None."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.leader else None
        self._collective("gather", dist.gather, x.contiguous(), parts, dst=0, group=self.compute,
                         wait_s=self.timeout_s)
        return torch.cat(parts, dim=-1) if self.leader else None

    def lead(self, kind: str, *args: Any) -> AbstractContextManager[None]:
        """Rank 0: send every follower the call it is about to make itself, and hold the group while it makes
        it (`with group.lead(...): ...`). Elsewhere: nothing to send (the followers make this call because
        rank 0's message told them to)."""
        return self._leading(kind, args) if self.leader else nullcontext()

    def send_limits(self, max_running: int, max_step_tokens: int) -> None:
        """Rank 0: tell the followers the engine's limits, once, before the capture and any step. Not a call they
        make: their receive() keeps them (wire.Limits) and bounds every later message's length by them."""
        if self.leader and self.size > 1:
            with self._leading("limits", (max_running, max_step_tokens)):
                pass

    @contextmanager
    def _leading(self, kind: str, args: tuple) -> Iterator[None]:
        with self._lock:
            if self.closed or self.failure:
                raise RunFailure(self.failure or f"tensor-parallel rank 0 of {self.size}: {kind} after the group "
                                 f"was closed")
            if self.size > 1:
                self._send(kind, *args, wait_s=self.timeout_s if kind == "run_step" else STARTUP_TIMEOUT_S)
            yield

    def receive(self) -> tuple | None:
        """A follower: wait for rank 0's next call, (kind, *args) (None: stop). A message that does not follow
        its schema, or announces more than it could hold, is a RunFailure naming what is wrong."""
        while (message := self._receive_one())[0] == "limits":  # the wire's own: no call to make
            self.limits = replace(self.limits, max_running=message[1], max_step_tokens=message[2])
        if message[0] == "build_runner":  # the pool every later step's blocks are in
            self.limits = replace(self.limits, num_blocks=message[2])
        return None if message[0] == "stop" else message

    def _receive_one(self) -> tuple:
        header = torch.zeros(wire.HEADER_LEN, dtype=torch.int64)
        self._collective("receive", dist.broadcast, header, src=0, group=self.control, wait_s=None)
        try:
            # Checked against what this message could hold before it is sized: a header is 24 bytes from the
            # network, the payload it announces is memory this rank allocates.
            payload = torch.zeros(wire.payload_len(header, self.limits), dtype=torch.int64)
            if payload.numel():
                self._collective("receive", dist.broadcast, payload, src=0, group=self.control, wait_s=None)
            return wire.unpack(header, payload)
        except wire.Malformed as e:
            raise RunFailure(f"tensor-parallel rank {self.rank} of {self.size}: malformed control message "
                             f"from rank 0 ({e})") from None

    def close(self) -> None:
        """Rank 0: tell the followers to stop (if they can still hear it), end them (on_close), then release
        the groups. A call still in flight on another thread (the engine's step) is waited for up to the
        timeout, which bounds each of its collectives; past that the groups are left alone."""
        idle = self._lock.acquire(timeout=self.timeout_s)
        try:
            # After a failed collective a follower may be mid-message (a send that timed out can still arrive):
            # a stop message would be read as the rest of it. on_close ends the followers instead.
            in_step = not (self.closed or self.failure)
            if idle and in_step and self.leader and self.size > 1 and self.control is not None:
                try:
                    self._send("stop", wait_s=self.timeout_s)
                except RunFailure:
                    pass  # a follower is gone or hung; on_close ends it
            self.closed = True
            for action in self.on_close:
                action()
            self.on_close.clear()
            # After the followers are gone: work still pending on a group (a send to a hung follower) then
            # fails at once instead of holding destroy_process_group until gloo's own timeout.
            if idle and self.compute is not None and dist.is_initialized():
                dist.destroy_process_group()
                self.compute = self.control = None
        finally:
            if idle:
                self._lock.release()

    def _send(self, kind: str, *args: Any, wait_s: float) -> None:
        header, payload = wire.pack(kind, *args)
        self._collective("broadcast", dist.broadcast, header, src=0, group=self.control, wait_s=wait_s)
        if payload.numel():
            self._collective("broadcast", dist.broadcast, payload, src=0, group=self.control, wait_s=wait_s)

    def _collective(self, what: str, fn, *args, wait_s: float | None, **kwargs) -> None:
        """fn(*args, **kwargs) as async work, waited for up to wait_s seconds (None: as long as it takes)."""
        t0 = time.perf_counter()
        try:
            work = fn(*args, async_op=True, **kwargs)
            # A CUDA graph being captured cannot wait on the host: its collectives are bounded at replay by
            # NCCL's own watchdog (the group's timeout), not here.
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if wait_s is not None and not capturing:
                work.wait(timedelta(seconds=wait_s))
            else:
                work.wait()
        except RuntimeError as e:  # gloo and NCCL report a lost peer and a timeout alike, as RuntimeError
            limit = self.timeout_s if wait_s is None else wait_s
            self.failure = (f"tensor-parallel rank {self.rank} of {self.size}: {what} failed ({_reason(e)}); "
                            f"another rank exited or hung longer than the {limit:g} s timeout")
            raise RunFailure(self.failure) from None
        self.calls[what] += 1
        self.seconds[what] += time.perf_counter() - t0


def _reason(e: Exception) -> str:
    """gloo's message without its source location and its advice: "Connection closed by peer [...]"."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0].rstrip(".")

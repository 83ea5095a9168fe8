"""The engine thread: the only code that touches the engine, stepping it while HTTP handlers come and go.

The engine is synchronous and one step takes milliseconds to seconds, so it cannot run inside the event
loop: every client would freeze for every step. It runs in a thread of its own instead, and talks to the event loop through two queues:

  inbox (thread-safe queue.Queue)    handlers put ("submit", ...) and ("abort", id); the engine thread
                                     drains it between steps, so the engine never changes under a step
  each request's EventBuffer         the engine thread gathers the events of one pass (a drain of the
                                     inbox, or one step's output for every request) in an Outbox and hands
                                     them over in one call_soon_threadsafe: one wake-up of the event loop
                                     per step, not one per request; the handler awaits them (Accepted or
                                     Failed first, then Deltas, then Finished); a reader that lags gets its
                                     Deltas merged, one that stalls is cut

After each step the thread turns every choice's new tokens into text (detokenizer, then stop strings), so
a stop string ends its sequence in the same step the text shows it, with no round trip to a handler.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from lessons.l4_continuous.sequence import Status
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l9_server.detokenizer import IncrementalDetokenizer, TokenBytes
from lessons.l9_server.engine import L9Engine
from lessons.l9_server.metrics import ServerMetrics
from lessons.l9_server.protocol import ApiError, GenerationRequest
from lessons.l9_server.stop_strings import StopStringMatcher
from shared.errors import CourseError, RunFailure
from shared.generation import StopRule

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


@dataclass
class Accepted:
    prompt_tokens: int


@dataclass
class Delta:
    """New output of one choice: text safe to show, the tokens it came from, and the finish reason once."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Finished:
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    error: ApiError


Event = Accepted | Delta | Finished | Failed


class EventBuffer:
    """One request's events on the event loop, in order; a lagging reader's Deltas merged, its lag bounded.

    A client that reads slowly, or not at all, blocks its stream at the socket while the engine runs on: a
    plain queue would grow by a Delta per choice per step for as long as the request runs. Here, once
    MERGE_AFTER entries wait, a new Delta joins its choice's last waiting Delta (text joined, tokens
    extended, the finish reason kept), as vLLM's output collector does, so no more than MERGE_AFTER + one per
    choice + Accepted + the final event ever wait. A reader `max_lag` tokens behind in one choice is cut:
    `on_lag` runs once (the app aborts the request) and a Failed follows what waits; nothing after it.
    """

    MERGE_AFTER = 16  # below this, a reader that keeps up gets one Delta per step, as the engine made them

    def __init__(self) -> None:
        self._entries: deque[Event] = deque()
        self._last: dict[int, Delta] = {}  # choice index -> its newest Delta still waiting
        self._lag: dict[int, int] = {}  # choice index -> its tokens waiting
        self._ready = asyncio.Event()
        self.closed = False  # a final event waits or was taken: nothing more is kept
        self.finished = False  # the reader has taken the final event (Finished or Failed)
        self.max_lag: int | None = None  # None: no bound (a whole response gathers everything anyway)
        self.on_lag: Callable[[], None] | None = None

    def qsize(self) -> int:
        return len(self._entries)

    # Task L9.6: one request's events in order; a lagging reader's Deltas merged, one past max_lag cut
    def push(self, event: Event) -> None:
        """Called on the event loop, for each event the engine thread sends."""
        if self.closed:  # a reader cut for lag: the engine's events until its abort lands go nowhere
            return
        if isinstance(event, Delta):
            lag = self._lag[event.index] = self._lag.get(event.index, 0) + len(event.token_ids)
            if self.max_lag is not None and lag > self.max_lag:
                self.closed = True
                self._append(Failed(ApiError(503, f"the client fell more than {self.max_lag} tokens behind its "
                                                  f"stream; the request was aborted", kind="server_error",
                                             code="slow_reader")))
                if self.on_lag is not None:
                    self.on_lag()
                return
            waiting = self._last.get(event.index)
            if waiting is not None and len(self._entries) >= self.MERGE_AFTER:
                waiting.text += event.text
                waiting.token_ids.extend(event.token_ids)  # a slice the engine made for this Delta alone
                waiting.finish_reason = waiting.finish_reason or event.finish_reason
                return
            self._last[event.index] = event
        elif isinstance(event, (Finished, Failed)):
            self.closed = True
        self._append(event)

    def _append(self, event: Event) -> None:
        self._entries.append(event)
        self._ready.set()

    def empty(self) -> bool:
        return not self._entries

    # Task L9.6: one request's events in order; a lagging reader's Deltas merged, one past max_lag cut
    async def get(self) -> Event:
        """The oldest event, waiting for one if none is there. Cancelling the wait loses nothing."""
        while not self._entries:
            self._ready.clear()
            await self._ready.wait()
        return self.get_nowait()

    # Task L9.6: one request's events in order; a lagging reader's Deltas merged, one past max_lag cut
    def get_nowait(self) -> Event:
        """The oldest event; asyncio.QueueEmpty if none is there."""
        if not self._entries:
            raise asyncio.QueueEmpty
        event = self._entries.popleft()
        if isinstance(event, Delta):
            self._lag[event.index] -= len(event.token_ids)
            if self._last.get(event.index) is event:
                del self._last[event.index]
        self.finished |= isinstance(event, (Finished, Failed))
        return event


class Subscriber:
    """The handler's end: an EventBuffer on the event loop, filled from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.events = loop, EventBuffer()

    def put(self, event: Event) -> None:
        """One event on its own (the engine thread sends through an Outbox instead)."""
        call_soon(self.loop, self.events.push, event)


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop has closed (the server is exiting): nobody is listening
        pass


def deliver(batch: list[tuple[EventBuffer, Event]]) -> None:
    """On the event loop: one pass's events, pushed in the order the engine thread made them."""
    for events, event in batch:
        events.push(event)


class Outbox:
    """The events of one pass of the engine thread, handed to the event loop together.

    Each call_soon_threadsafe wakes the event loop through its self-pipe (a syscall on each side) and
    queues a callback: one per request per step would cost the engine thread, which is the server's
    bottleneck, a wake-up for every stream. Order is kept: one list, delivered in one callback per loop."""

    def __init__(self) -> None:
        self.pending: list[tuple[Subscriber, Event]] = []

    def put(self, subscriber: Subscriber, event: Event) -> None:
        self.pending.append((subscriber, event))

    def flush(self) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[EventBuffer, Event]]] = {}
        for subscriber, event in self.pending:  # one loop in a server; tests may run several
            batches.setdefault(subscriber.loop, []).append((subscriber.events, event))
        self.pending = []
        for loop, batch in batches.items():
            call_soon(loop, deliver, batch)


@dataclass
class Choice:
    """One output of a request (n > 1: one per sibling) as the engine thread tracks it."""

    seq: SharedSequence
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    sent: int = 0  # output tokens already turned into text
    last_token_at: float | None = None
    finish_reason: str | None = None


@dataclass
class Job:
    request: GenerationRequest
    prompt_ids: list[int]
    subscriber: Subscriber
    arrival: float  # perf_counter() when the handler submitted it: TTFT counts queueing too
    choices: list[Choice] = field(default_factory=list)


class EngineLoop:
    def __init__(self, engine: L9Engine, token_bytes: TokenBytes, metrics: ServerMetrics, eos_ids: frozenset[int],
                 max_waiting: int):
        self.engine, self.token_bytes, self.metrics = engine, token_bytes, metrics
        self.eos_ids, self.max_waiting = eos_ids, max_waiting
        self.inbox: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}  # engine thread only
        self.outbox = Outbox()  # engine thread only: flushed after each drain and each step
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.accepting = True
        self.failure: str | None = None
        self._ids = itertools.count()
        # submit's checks and its put into the inbox happen under this lock, and the engine thread sets
        # `_closed` under it before its last drain of the inbox: a request submitted is always answered.
        self._lock = threading.Lock()
        self._closed = False
        self._in_inbox = 0  # sequences (n per request) submitted, not yet drained by the engine thread
        self._engine_waiting = 0  # sequences the scheduler has yet to admit (unforked siblings too), last step

    # --- called from the event loop ---

    def start(self) -> None:
        self.thread.start()

    # Task L9.8: the inbox: submit (429 past max_waiting), drained between steps: admit (a pool refusal: 400) or abort
    def submit(self, prompt_ids: list[int], request: GenerationRequest, subscriber: Subscriber) -> int:
        """Queue a request for the engine thread; refuse it at once if the server cannot take it. Each of its
        n choices is a sequence the engine must run, so each counts against max_waiting."""
        if request.n > self.max_waiting:  # a 429 would send the client back for ever: it can never fit
            raise ApiError(400, f"n ({request.n}) exceeds the {self.max_waiting} sequences this server queues "
                                f"(--max-waiting)", "n")
        with self._lock:
            if self.failure is not None:
                raise ApiError(503, f"the engine has failed: {self.failure}", kind="server_error")
            if self._closed or not self.accepting:
                raise ApiError(503, "the server is shutting down", kind="server_error")
            if self._in_inbox + self._engine_waiting + request.n > self.max_waiting:
                raise ApiError(429, f"{self.max_waiting} sequences are already waiting; retry in {RETRY_AFTER_S} s",
                               kind="rate_limit_error")
            self._in_inbox += request.n
            request_id = next(self._ids)
            self.inbox.put(("submit", request_id, Job(request, prompt_ids, subscriber, time.perf_counter())))
        return request_id

    def abort(self, request_id: int) -> None:
        self.inbox.put(("abort", request_id, None))

    def stop(self, timeout: float = 10.0) -> None:
        self.accepting = False
        self.inbox.put(("stop", -1, None))
        self.thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        return self._in_inbox + self._engine_waiting

    # --- the engine thread ---

    def _run(self) -> None:
        try:
            self.metrics.update(self.engine)  # a fresh server's pool, before the first request arrives
            while self._drain(block=not self.engine.scheduler.has_work()):
                self.outbox.flush()  # Accepted (or a refusal) before the step: headers go out meanwhile
                if self.engine.scheduler.has_work():
                    self.engine.step()
                    self._emit(time.perf_counter())
                    self.outbox.flush()
                self._engine_waiting = sum(1 + len(s.extra.get("forks", ())) for s in self.engine.scheduler.waiting)
                self.metrics.update(self.engine)
        except Exception as e:  # a bug, or the device failing: every request in flight learns of it
            if isinstance(e, RunFailure):  # a rank of a split model (L10) is gone: one line says which and why
                print(f"error: {e}", file=sys.stderr, flush=True)
            else:
                traceback.print_exc()
            self.failure = f"{type(e).__name__}: {e}"
        finally:
            self._close()

    def _close(self) -> None:
        """Answer every request the thread knows of, and every one still in the inbox, with a 503."""
        with self._lock:  # after this, submit refuses: all it ever put in the inbox is drained below
            self._closed, self.accepting = True, False
        failed = Failed(ApiError(503, self.failure or "the server is shutting down", kind="server_error"))
        for job in self.jobs.values():
            self.outbox.put(job.subscriber, failed)  # after whatever a failed pass left unsent: order kept
        self.jobs.clear()
        while True:
            try:
                kind, _, job = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self.outbox.put(job.subscriber, failed)
        self.outbox.flush()

    # Task L9.8: the inbox: submit (429 past max_waiting), drained between steps: admit (a pool refusal: 400) or abort
    def _drain(self, block: bool) -> bool:
        """Handle everything in the inbox (waiting for one message first if idle). False: stop."""
        while True:
            try:
                kind, request_id, job = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "submit":
                self._admit(request_id, job)
            elif request_id in self.jobs:  # an abort whose request is still running
                self._end(request_id, "abort")

    # Task L9.8: the inbox: submit (429 past max_waiting), drained between steps: admit (a pool refusal: 400) or abort
    def _admit(self, request_id: int, job: Job) -> None:
        req = job.request
        try:
            stop = StopRule(req.max_tokens, self.eos_ids, req.ignore_eos)
            seqs = self.engine.add_parallel(job.prompt_ids, stop, req.sampling, req.n)
        except CourseError as e:  # the app checked the fields; what is left is the pool: a request it can never hold
            self.outbox.put(job.subscriber, Failed(ApiError(400, str(e), "max_tokens")))
            return
        except Exception:  # an engine bug, its state now unknown: the loop fails, and this request learns it too
            self.jobs[request_id] = job
            raise
        finally:
            with self._lock:
                self._in_inbox -= req.n
        job.choices = [Choice(seq, IncrementalDetokenizer(self.token_bytes), StopStringMatcher(req.stop_strings))
                       for seq in seqs]
        self.jobs[request_id] = job
        self.outbox.put(job.subscriber, Accepted(len(job.prompt_ids)))

    # Task L9.7: after a step, each choice's new tokens -> text -> stop strings -> a Delta; finishes, Finished
    def _emit(self, now: float) -> None:
        """Every choice that gained tokens in this step: text out, stop strings checked, finishes sent."""
        for request_id, job in list(self.jobs.items()):
            for index, choice in enumerate(job.choices):
                seq = choice.seq
                new = seq.output_ids[choice.sent:]
                if choice.finish_reason is not None or not new:
                    continue
                latency = self.metrics.ttft if choice.last_token_at is None else self.metrics.itl
                latency.observe(now - (choice.last_token_at or job.arrival))  # one per step, however many tokens
                choice.last_token_at = now
                text, new = self._text_of(choice, new)
                choice.sent += len(new)
                if not choice.stops.stopped and seq.status is Status.FINISHED:
                    text += choice.stops.push(choice.detokenizer.flush())  # a split character is never finished
                    text += choice.stops.flush()
                if choice.stops.stopped:
                    self.engine.abort([seq])  # a stop string: the sequence ends here, its blocks go back
                    choice.finish_reason = "stop"
                elif seq.status is Status.FINISHED:
                    choice.finish_reason = self._finish_reason(seq, job.request)
                self.outbox.put(job.subscriber, Delta(index, text, new, choice.finish_reason))
                if choice.finish_reason is not None:
                    self.metrics.requests.labels(choice.finish_reason).inc()
            if all(c.finish_reason is not None for c in job.choices):
                self.outbox.put(job.subscriber, Finished(len(job.prompt_ids), sum(c.sent for c in job.choices)))
                self._end(request_id, None)

    # Task L9.7: after a step, each choice's new tokens -> text -> stop strings -> a Delta; finishes, Finished
    @staticmethod
    def _text_of(choice: Choice, new: list[int]) -> tuple[str, list[int]]:
        """The text a step's new tokens release, and the tokens it came from: all of them, unless a stop string
        completes at one of them. A step of L11's may bring several tokens (accepted drafts): they are fed one
        at a time then, so the output ends at the token where it would end one token per step, and the Delta's
        tokens and the usage count stop there too. The text is the same either way (both stages are
        incremental); only the token where a stop completes needs the loop, so one token, or no stop
        strings, costs one call."""
        if len(new) == 1 or not choice.stops.stops:
            return choice.stops.push(choice.detokenizer.push(new)), new
        pieces = []
        for used, token in enumerate(new, 1):
            pieces.append(choice.stops.push(choice.detokenizer.push([token])))
            if choice.stops.stopped:
                return "".join(pieces), new[:used]
        return "".join(pieces), new

    # Task L9.7: after a step, each choice's new tokens -> text -> stop strings -> a Delta; finishes, Finished
    def _finish_reason(self, seq: SharedSequence, req: GenerationRequest) -> str:
        last = seq.output_ids[-1]
        eos = not req.ignore_eos and last in self.eos_ids
        # the sequence's own stop ids: L13's engine adds a grammar's EOS to the request's
        return "stop" if eos or last in seq.sampling.stop_token_ids else "length"

    # Task L9.7: after a step, each choice's new tokens -> text -> stop strings -> a Delta; finishes, Finished
    def _end(self, request_id: int, reason: str | None) -> None:
        """Forget a request; `reason` "abort": its client left, so its sequences stop wherever they are."""
        job = self.jobs.pop(request_id)
        if reason == "abort":
            self.engine.abort([c.seq for c in job.choices])
            # A finish is counted per choice, as _emit counts stop and length: the choices this abort ends
            unfinished = sum(c.finish_reason is None for c in job.choices)
            if unfinished:
                self.metrics.requests.labels("abort").inc(unfinished)
        for choice in job.choices:
            self.engine.forget(choice.seq.seq_id)

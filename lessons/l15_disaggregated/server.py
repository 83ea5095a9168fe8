"""L15's servers: scripts/serve.py --kv-role kv_producer (P, the prefill server) or kv_consumer (D, the decode
server), on L9's app and engine thread. What a request's `kv_transfer_params` adds to L9's path (vLLM's flow and its
NIXL connector's fields; proxy.py sends them):

  taken out of the body before L9's parser sees it (KvFields, in the slot L13's structured outputs use), checked
  against the server's role, carried to the engine thread in the checked request (KvRequest)
  P  {"do_remote_decode": true}   the request runs as any other (the proxy asks one token). As it finishes, on the
                                  engine thread before the next step can evict anything, its prompt's full blocks
                                  are leased (engine.request_finished) and the whole response carries the lease as a
                                  top-level kv_transfer_params. Expired leases are freed between steps and, while no
                                  request runs, once a second (the engine thread's idle wait wakes for it)
  D  {"do_remote_prefill": true, ...}   (P's answer) on the engine thread consumer.start takes D's blocks (no room:
                                  503 with Retry-After, nothing taken); a worker thread pulls the pages, so neither the
                                  engine thread (it steps the other requests) nor the event loop (it streams them)
                                  waits on the network; back on the engine thread consumer.finish files them in D's
                                  prefix cache and the request is admitted as L9 admits any (n and seed as asked):
                                  its prompt hits those blocks and it streams like any request. A pull that fails
                                  is recomputed, or with --kv-load-failure-policy fail refused with a 502. A client
                                  that leaves while its pages are in flight: when the pull returns (never during it:
                                  it writes into those blocks) they are freed and nothing is added

P and D are L9's servers otherwise: a request without kv_transfer_params is served as L14's server serves it.
"""
from __future__ import annotations

import json
import queue
import sys
import threading
from dataclasses import dataclass, field, fields

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge

from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l9_server.app import MAX_BODY_BYTES, ServedModel, create_app
from lessons.l9_server.engine_loop import RETRY_AFTER_S, EngineLoop, Failed, Finished, Job, Outbox, Subscriber
from lessons.l9_server.metrics import PREFIX
from lessons.l9_server.protocol import ApiError, GenerationRequest
from lessons.l13_structured.server import StructuredOutputs
from lessons.l15_disaggregated.connector import NoRoom, PendingLoad, TransferFailed, check_params
from lessons.l15_disaggregated.engine import L15Engine
from lessons.l15_disaggregated.transfer import MAX_BLOCKS
from shared.errors import CourseError
from shared.generation import StopRule

PARAM = "kv_transfer_params"
IDLE_WAKE_S = 1.0  # the engine thread's idle wait gives up this often: P frees expired leases while nothing runs


@dataclass(frozen=True)
class KvRequest(GenerationRequest):
    """A checked request that asks for a transfer: P's lease or D's pull (its kv_transfer_params as checked)."""

    kv_transfer_params: dict | None = None


@dataclass
class Leased(Finished):
    """P's last event for a request that asked do_remote_decode: L9's Finished, plus the top-level fields of the
    whole response (L9's app adds them): the lease, as kv_transfer_params."""

    fields: dict = field(default_factory=dict)


class Busy(ApiError):
    """503 with Retry-After: D has too few free blocks for the pull now (backpressure); nothing was taken."""

    def __init__(self, message: str):
        super().__init__(503, message, kind="server_error", code="kv_no_room")


def kv_transfer(params: object, role: str) -> dict | None:
    """A body's kv_transfer_params checked against this server's role: the params when they ask for a transfer, None
    when they ask for none (vLLM's proxy sends P the other fields as nulls). Anything else is a 400 naming the field."""
    if not isinstance(params, dict):
        raise ApiError(400, f"{PARAM} must be an object", PARAM)
    lease, pull = params.get("do_remote_decode"), params.get("do_remote_prefill")
    for name, value in (("do_remote_decode", lease), ("do_remote_prefill", pull)):
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"{PARAM}.{name} must be true or false, got {value!r}", f"{PARAM}.{name}")
    if lease and pull:
        raise ApiError(400, f"{PARAM} asks for do_remote_decode and do_remote_prefill at once", PARAM)
    if lease:
        if role != "kv_producer":
            raise ApiError(400, f"{PARAM}.do_remote_decode asks this server to prefill for a decode server: that is a "
                                f"prefill server's (--kv-role kv_producer); this one is {role}",
                           f"{PARAM}.do_remote_decode")
        return params
    others = {k: v for k, v in params.items() if k not in ("do_remote_decode", "do_remote_prefill")}
    if not pull and all(v is None for v in others.values()):
        return None
    if role != "kv_consumer":
        raise ApiError(400, f"{PARAM} from a prefill server are for a decode server (--kv-role kv_consumer); this "
                            f"one is {role}", PARAM)
    try:
        check_params(params, MAX_BLOCKS)  # the fields' shapes; the block count against the prompt on the engine thread
    except CourseError as e:
        raise ApiError(400, str(e), PARAM) from None
    return params


@dataclass
class Taken:
    spec: object  # L13's GrammarSpec, or None
    kv_transfer_params: dict


class KvFields:
    """create_app's request hook (the slot L13's structured outputs take): kv_transfer_params out of the body before
    L9's parser sees it, into the checked request after; L13's fields pass through to L13's hook."""

    def __init__(self, role: str, structured: StructuredOutputs | None):
        self.role, self.structured = role, structured

    # Task L15.8: the servers: P leases as a request ends, D pulls off the engine thread, the proxy sends P then D
    def take(self, body: dict) -> tuple[dict, object]:
        """(the body without kv_transfer_params, and what the hook will need: L13's spec, or a Taken when the
        request asks for a transfer). A bad kv_transfer_params is a 400 here, before any work is done."""
        params = body.get(PARAM)
        rest = {k: v for k, v in body.items() if k != PARAM}
        rest, spec = self.structured.take(rest) if self.structured else (rest, None)
        if PARAM not in body:
            return rest, spec
        params = kv_transfer(params, self.role)
        return rest, spec if params is None else Taken(spec, params)

    # Task L15.8: the servers: P leases as a request ends, D pulls off the engine thread, the proxy sends P then D
    async def constrain(self, req: GenerationRequest, taken: object) -> GenerationRequest:
        """The checked request: with L13's grammar if one was asked for, as a KvRequest if a transfer was."""
        if not isinstance(taken, Taken):
            return await self.structured.constrain(req, taken)
        if taken.kv_transfer_params.get("do_remote_decode") and req.stream:
            raise ApiError(400, f"{PARAM}.do_remote_decode needs stream false: the lease comes back in the whole "
                                "response (as vLLM's)", "stream")
        if taken.spec is not None:
            req = await self.structured.constrain(req, taken.spec)
        values = {f.name: getattr(req, f.name) for f in fields(GenerationRequest)}
        return KvRequest(**values, kv_transfer_params=taken.kv_transfer_params)


class KvMetrics:
    """L15's lines in /metrics: P's open leases, D's pulls by how they ended."""

    def __init__(self, registry: CollectorRegistry):
        self.leases = Gauge(PREFIX + "kv_leases", "Prompts whose blocks this prefill server holds for a decode "
                            "server to pull (until it releases them or the lease expires).", registry=registry)
        self.pulls_in_flight = Gauge(PREFIX + "kv_pulls_in_flight", "Requests whose pages are on their way from a "
                                     "prefill server (their blocks taken, not yet filled).", registry=registry)
        self.pulls = Counter(PREFIX + "kv_pulls", "Requests prefilled elsewhere, by how their pages came: pulled "
                             "(or held by D already), recomputed (the pull failed), failed (refused: policy fail), "
                             "abandoned (the client left while they were in flight).", ["result"], registry=registry)
        self.pulled_blocks = Counter(PREFIX + "kv_pulled_blocks", "Blocks pulled from prefill servers.",
                                     registry=registry)
        for result in ("pulled", "recomputed", "failed", "abandoned"):
            self.pulls.labels(result)


class LeasingOutbox(Outbox):
    """P's outbox: the Finished event of a request that asked do_remote_decode leaves with the lease on its prompt."""

    def __init__(self, lease):
        super().__init__()
        self.lease = lease  # Subscriber -> kv_transfer_params, or None (the request asked for no lease)

    # Task L15.8: the servers: P leases as a request ends, D pulls off the engine thread, the proxy sends P then D
    def put(self, subscriber: Subscriber, event) -> None:
        """On the engine thread, as _emit sends a request's last event: right after the step that finished it, so
        its prompt's blocks are still in the prefix cache (the next step could evict them)."""
        if isinstance(event, Finished):
            params = self.lease(subscriber)
            if params is not None:
                event = Leased(event.prompt_tokens, event.completion_tokens, {PARAM: params})
        super().put(subscriber, event)


@dataclass
class Pull:
    job: Job
    pending: PendingLoad
    aborted: bool = False  # the client left: when the pull returns, its blocks are freed and nothing is added


class KvEngineLoop(EngineLoop):
    """L9's engine thread for P or D. P: leases as requests finish (LeasingOutbox), frees leases between steps and
    while idle. D: pulls on worker threads, each pull's request admitted when its pages have landed."""

    def __init__(self, engine: L15Engine, *args, **kwargs):
        super().__init__(engine, *args, **kwargs)
        if engine.kv_role == "kv_both":
            raise CourseError("KvEngineLoop serves a prefill or a decode engine (kv_producer or kv_consumer)")
        self.kv_metrics = KvMetrics(self.metrics.registry)
        self.leasing: dict[Subscriber, SharedSequence] = {}  # P: requests that lease as they finish (engine thread)
        self.pulls: dict[int, Pull] = {}  # D: request id -> its pull in flight (engine thread only)
        if engine.producer is not None:
            self.outbox = LeasingOutbox(self._lease)

    # Task L15.8: the servers: P leases as a request ends, D pulls off the engine thread, the proxy sends P then D
    def _drain(self, block: bool) -> bool:
        """L9's drain, plus: P frees released and expired leases first, and an idle wait gives up after IDLE_WAKE_S
        (so a lease expires while no request runs); a "pulled" message (a worker's pull done) finishes that
        request's load; an abort reaches a request whose pages are in flight (they are freed when they land)."""
        self._reap()
        while True:
            try:
                kind, request_id, job = self.inbox.get(block=block, timeout=IDLE_WAKE_S if block else None)
            except queue.Empty:  # nothing (more) came; an idle wait that woke reaps now, before /metrics is updated
                if block:
                    self._reap()
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "submit":
                self._admit(request_id, job)
            elif kind == "pulled":
                self._pulled(request_id)
            elif request_id in self.pulls:
                self.pulls[request_id].aborted = True
            elif request_id in self.jobs:
                self._end(request_id, "abort")

    # Task L15.8: the servers: P leases as a request ends, D pulls off the engine thread, the proxy sends P then D
    def _admit(self, request_id: int, job: Job) -> None:
        """A request without a transfer is L9's. P: admitted as L9's, and noted to lease as it finishes. D: its
        pull starts (the blocks taken here, the pages fetched on a worker thread)."""
        params = getattr(job.request, "kv_transfer_params", None)
        if params is None:
            super()._admit(request_id, job)
        elif self.engine.producer is not None:
            super()._admit(request_id, job)
            if request_id in self.jobs:  # admitted (not refused): its first choice's prompt is the request's
                self.leasing[job.subscriber] = job.choices[0].seq
        else:
            self._start_pull(request_id, job)

    # Task L15.8: the servers: P leases as a request ends, D pulls off the engine thread, the proxy sends P then D
    def _start_pull(self, request_id: int, job: Job) -> None:
        """D, engine thread: refuse what can never fit (400) or does not fit now (503), else take the blocks and hand
        the pull to a worker thread. The request still counts as waiting (max_waiting) until it is admitted."""
        req = job.request
        stop = StopRule(req.max_tokens, self.eos_ids, req.ignore_eos)
        need = SharedSequence(list(job.prompt_ids), self.engine.block_size, stop=stop).max_blocks
        if need > self.engine.scheduler.capacity:  # L4's size rule (what L9's _admit refuses), before a block is taken
            self._refuse(job, ApiError(400, f"prompt ({len(job.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) "
                                            f"needs {need} blocks; the whole pool has {self.engine.scheduler.capacity}",
                                       "max_tokens"))
            return
        try:
            pending = self.engine.consumer.start(job.prompt_ids, req.kv_transfer_params)
        except NoRoom as e:
            self._refuse(job, Busy(f"{e}; retry in {RETRY_AFTER_S} s"))
            return
        except CourseError as e:  # the params against this prompt (more blocks than it fills)
            self._refuse(job, ApiError(400, str(e), PARAM))
            return
        self.pulls[request_id] = Pull(job, pending)
        self.kv_metrics.pulls_in_flight.set(len(self.pulls))
        threading.Thread(target=self._pull, args=(request_id, pending), name=f"kv-pull-{request_id}",
                         daemon=True).start()

    # Task L15.8: the servers: P leases as a request ends, D pulls off the engine thread, the proxy sends P then D
    def _pull(self, request_id: int, pending: PendingLoad) -> None:
        """A worker thread: the pages over the network (each socket operation under the connector's timeout), then
        back to the engine thread through the inbox."""
        try:
            self.engine.consumer.pull(pending)
        except Exception as e:  # a bug, or input the connector did not foresee: a failed pull, never a wrong page
            if pending.fresh:  # as the connector: with nothing to fill, a release that failed fails nothing
                pending.error = f"{type(e).__name__}: {e}"
        finally:
            self.inbox.put(("pulled", request_id, None))

    # Task L15.8: the servers: P leases as a request ends, D pulls off the engine thread, the proxy sends P then D
    def _pulled(self, request_id: int) -> None:
        """D, engine thread, the pull returned: abandoned (its client left), refused (policy fail: 502), or filed in
        the prefix cache (or to be recomputed) and admitted as L9 admits any request."""
        pull = self.pulls.pop(request_id)
        self.kv_metrics.pulls_in_flight.set(len(self.pulls))
        consumer, job = self.engine.consumer, pull.job
        if pull.aborted:
            consumer.abandon(pull.pending)
            self._forget_waiting(job)
            self.kv_metrics.pulls.labels("abandoned").inc()
            return
        try:
            loaded = consumer.finish(pull.pending)
        except TransferFailed as e:
            # 502: the upstream (P) failed D, not D itself; a retry of these params fails again (the lease is gone)
            self._refuse(job, ApiError(502, str(e), kind="server_error", code="kv_transfer_failed"))
            self.kv_metrics.pulls.labels("failed").inc()
            return
        if loaded.failed:
            print(f"request {request_id}: pulling its pages failed ({loaded.failed}); its prompt is recomputed "
                  f"(--kv-load-failure-policy recompute)", file=sys.stderr, flush=True)
        self.kv_metrics.pulls.labels("recomputed" if loaded.failed else "pulled").inc()
        self.kv_metrics.pulled_blocks.inc(loaded.pulled)
        super()._admit(request_id, job)

    def _reap(self) -> None:
        """P: free the blocks of leases released or expired (the engine thread's, between steps)."""
        if self.engine.producer is not None:
            self.engine.producer.reap()
            self.kv_metrics.leases.set(len(self.engine.producer.leases))

    def _refuse(self, job: Job, error: ApiError) -> None:
        self._forget_waiting(job)
        self.outbox.put(job.subscriber, Failed(error))

    def _forget_waiting(self, job: Job) -> None:
        """A request that leaves before L9's _admit sees it gives back its place among the waiting (submit counted
        it; L9's _admit gives it back for the others)."""
        with self._lock:
            self._in_inbox -= job.request.n

    def _lease(self, subscriber: Subscriber) -> dict | None:
        """P, engine thread: the kv_transfer_params of a request that asked to lease, as it finishes."""
        seq = self.leasing.pop(subscriber, None)
        if seq is None:
            return None
        params = self.engine.request_finished(seq)
        self.kv_metrics.leases.set(len(self.engine.producer.leases))  # before the answer leaves
        return params

    def _end(self, request_id: int, reason: str | None) -> None:
        self.leasing.pop(self.jobs[request_id].subscriber, None)  # an aborted request leases nothing
        super()._end(request_id, reason)

    def _close(self) -> None:
        """L9's, plus an answer for each request whose pages are still in flight (the worker's message will find
        nobody to take it)."""
        failed = Failed(ApiError(503, self.failure or "the server is shutting down", kind="server_error"))
        for pull in self.pulls.values():
            self.outbox.put(pull.job.subscriber, failed)
        self.pulls.clear()
        super()._close()


def create_kv_app(model: ServedModel, loop: KvEngineLoop, default_max_tokens: int = 256,
                  max_body_bytes: int = MAX_BODY_BYTES, structured: StructuredOutputs | None = None) -> FastAPI:
    """L9's app, with kv_transfer_params taken by KvFields, and D's 503s for want of room sent with Retry-After."""
    app = create_app(model, loop, default_max_tokens, max_body_bytes, KvFields(loop.engine.kv_role, structured))

    async def busy(request: Request, e: Busy) -> Response:  # Starlette picks the most specific handler: this one
        loop.metrics.rejected.labels("503").inc()
        return Response(json.dumps(e.body()), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)},
                        media_type="application/json")

    app.add_exception_handler(Busy, busy)
    return app

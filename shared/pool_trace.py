"""Record what an engine does to its KV pool, step by step, as JSON lines: the trace the pool viewer replays.

A recorder watches an engine from outside. It wraps methods *on the engine's own objects* (the allocator, the
prefix cache, the host pool, the scheduler, the engine), never on their classes, and only while it is
attached: an engine nobody records runs exactly its own code, so recording costs nothing when it is off.

The first line is a header: the pool's size and its state when recording began (L7's dummy block is held by
no request). Then one record per engine step: the plan (what each request was fed), the events in the order
they happened, the block tables that changed, and every known request's status and lengths. Events:
  alloc / free / share   the allocator's calls and their blocks ("pool": "host" for L5's swap space)
  cow                    a copy-on-write (its alloc and free are events of their own, just before it)
  register / evict       a block named in the prefix cache, or dropped from it to be reused
  admit / hit / fork / preempt / swap_out / swap_in / draft / rollback / finish / abort
Work done between steps (a server's abort) gets a record of its own, "kind": "between".

L15's engines hold blocks that no block table holds, between steps and across them. The recorder watches their
connectors (`engine.producer`, `engine.consumer`) when the engine has them, and names these holders:
  lease   {lease, blocks, seq?}   P leased a finished prompt's full blocks (after its share event); `lease` is the
                                  lease id in hex (as D's kv_transfer_params name it), seq the request if known
  unlease {lease, blocks, why}    P ends a lease, "released" by D or "expired" (before the frees of its blocks)
  pull    {pull, lease, blocks, hits, tokens}   D took blocks for a pull (after their share and alloc): blocks =
                                  its own hits (the first `hits`) + the fresh blocks the pull fills; pull numbers
                                  D's pulls in the order they started; tokens: the prompt's length
  pulled  {pull, blocks, hits, outcome, error?}  D ended that pull (before its registers and frees): outcome
                                  "filed" (the fresh blocks enter its prefix cache), "recompute" or "refused" (the
                                  pull failed under policy recompute or fail) or "abandoned" (its client left)
The replay counts a lease or a pull in flight as a holder of its blocks, as it counts a table. A P's header and
`pool_state` carry its leases ({lease: blocks}); D's pulls in flight are the recorder's knowledge only (the
engine keeps no list of them: the server does). L15's records also carry "at", when the record's first event
happened (or its step began): time.time() unless a `stamp` is given, so two engines' traces, P's and D's, can be
stepped together in wall order (the viewer's --lesson l15 gives both recorders one counter). Earlier lessons'
records carry no "at" unless a stamp is given.
`shared/pool_replay.py` rebuilds the pool from these lines alone, and a test checks it against the engine.
"""
from __future__ import annotations

import io
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

KEY_FORMAT = "{:016x}"  # prefix-cache keys are 64-bit: JSON numbers lose the low bits in a browser


def pool_state(engine: Any, seqs: list[Any] | None = None) -> dict:
    """The pool as the engine holds it now, in the replay's terms (`PoolState.as_dict`)."""
    a = engine.allocator
    if hasattr(a, "ref"):  # L6's ref-counted manager
        ref, free, lru = list(a.ref), list(a._free), list(a._lru)
        cache = {b: KEY_FORMAT.format(entry.key) for b, entry in a.cache.entry.items()}
    else:  # L2's allocator: a block is held by one table or free
        ref, free, lru, cache = [0 if f else 1 for f in a._is_free], list(a._free), [], {}
    host = getattr(getattr(engine, "scheduler", None), "host", None)
    seqs = live_sequences(engine) if seqs is None else seqs
    producer = getattr(engine, "producer", None)  # L15's P: its leases hold blocks too
    return {
        "free": free, "lru": lru, "ref": ref, "cache": cache,
        "tables": {_id(s): list(s.blocks) for s in seqs if s.blocks},
        "host_free": list(host.allocator._free) if host is not None else [],
        "host_tables": {_id(s): list(s.extra["host_blocks"]) for s in seqs
                        if getattr(s, "extra", {}).get("host_blocks")},
        **({"leases": leases_of(producer)} if producer is not None else {}),
    }


def leases_of(producer: Any) -> dict[str, list[int]]:
    """L15's P: its live leases (released ones not yet freed included), {lease id in hex: blocks}."""
    leases = producer.leases
    with leases._lock:  # granted and released on other threads too
        return {KEY_FORMAT.format(i): list(lease.blocks) for i, lease in leases._leases.items()}


def live_sequences(engine: Any) -> list[Any]:
    sched = getattr(engine, "scheduler", None)
    if sched is None:
        return []
    return [*sched.running, *sched.waiting, *getattr(sched, "swapped", ())]


def _id(seq: Any) -> int:
    return seq.seq_id


def prefix_length(cache: Any, block: int) -> int | None:
    """The tokens a cached block's prefix holds; None when a parent entry has left the cache (never hit)."""
    prefix = cache.prefix(block)
    return None if prefix is None else len(prefix)


class PoolRecorder:
    """Attach to an engine (L2 on), write one JSON line per step to `out`; `close()` detaches and flushes."""

    def __init__(self, engine: Any, out: TextIO, lesson: str = "", stamp: Callable[[], float] | None = None):
        self.engine, self.out = engine, out
        paired = getattr(engine, "producer", None) is not None or getattr(engine, "consumer", None) is not None
        self.stamp = stamp if stamp is not None or not paired else time.time  # records' "at": see the docstring
        self._at: float | None = None  # when the record under way began
        self.events: list[dict] = []
        self.plan: list[dict] = []
        self.steps = 0
        self.known: dict[int, Any] = {}  # seq id -> the sequence, while it is alive or just ended
        self.tables: dict[int, tuple[int, ...]] = {}  # seq id -> its block table at the last record
        self.host_tables: dict[int, tuple[int, ...]] = {}
        self.lengths: dict[int, tuple] = {}  # seq id -> (status, num_cached, num_tokens) at the last record
        self.ids: dict[int, int] = {}  # L2/L3: requests have no seq_id; object id -> a number in arrival order
        self._l2: _L2Request | None = None  # L2's request now running, as far as its forwards show it
        self._undo: list[tuple[Any, str]] = []
        a = engine.allocator
        host = getattr(getattr(engine, "scheduler", None), "host", None)
        dummy = getattr(engine, "dummy_block", None)
        state = pool_state(engine, [])
        header = {"kind": "header", "lesson": lesson, "engine": type(engine).__name__,
                  "num_blocks": a.num_blocks, "block_size": engine.block_size,
                  "ref_counted": hasattr(a, "ref"), "host_blocks": host.allocator.num_blocks if host else 0,
                  "pinned": [dummy] if dummy is not None else [], **state}
        if paired:
            header["kv_role"] = engine.kv_role
        if self.stamp is not None:
            header["at"] = self.stamp()
        self._write(header)
        self._watch_allocator(a, "device")
        if host is not None:
            self._watch_allocator(host.allocator, "host")
        if hasattr(a, "cache"):
            self._wrap(a.cache, "register", lambda r, block, key, parent, tokens: r and self._event(
                "register", block=block, key=KEY_FORMAT.format(key), tokens=prefix_length(a.cache, block)))
            self._wrap(a.cache, "drop", lambda r, block: self._event("evict", block=block))
        if hasattr(a, "copy_on_write"):
            self._wrap(a, "copy_on_write", lambda r, block: self._event("cow", src=block, dst=r))
        self._watch_engine(engine)
        self._watch_connectors(engine)

    # --- wiring ---

    def _wrap(self, obj: Any, name: str, after: Callable[..., Any], before: Callable[..., Any] | None = None) -> None:
        """obj.name(*args) now also calls after(result, *args) (and before(*args) first); undone by close()."""
        real = getattr(obj, name)

        def watched(*args, **kwargs):
            if before is not None:
                before(*args, **kwargs)
            result = real(*args, **kwargs)
            after(result, *args, **kwargs)
            return result

        setattr(obj, name, watched)
        self._undo.append((obj, name))

    def _watch_allocator(self, a: Any, pool: str) -> None:
        self._wrap(a, "alloc", lambda r, n: self._event("alloc", pool=pool, blocks=list(r)))
        self._wrap(a, "free", lambda r, blocks: self._event("free", pool=pool, blocks=list(blocks)))
        if hasattr(a, "share"):
            self._wrap(a, "share", lambda r, blocks: self._event("share", blocks=list(blocks)))

    def _watch_engine(self, engine: Any) -> None:
        sched = getattr(engine, "scheduler", None)
        if sched is None:  # L2 and L3: no scheduler; every forward is a step
            if hasattr(engine, "runner"):  # L3: the static batch's requests are the forward's argument
                self._wrap(engine.runner, "forward", lambda r, reqs: self._end("step"), before=self._forward_l3)
            else:  # L2: one request at a time; the model proxy sees each forward's metadata
                engine.model = _ModelProxy(engine.model, self._forward_l2, lambda: self._end("step"))
                self._undo.append((engine, "model"))
            return
        self._wrap(engine, "step", lambda r: self._end("step"), before=lambda: self._begin())
        self._wrap(sched, "schedule", lambda plan: self._plan(plan))
        if hasattr(engine, "with_drafts"):  # L11 on: a decode may carry drafts
            self._wrap(engine, "with_drafts", lambda plan, *a: self._plan(plan))
        if hasattr(sched, "preempt"):
            self._wrap(sched, "preempt", lambda r, seq: self._event(
                "preempt", seq=_id(seq), to="host" if seq.status.value == "swapped" else "recompute"))
        if hasattr(sched, "fork"):
            self._wrap(sched, "fork", lambda r, parent: r and self._event(
                "fork", seq=_id(parent), children=[_id(c) for c in r]))
        if hasattr(sched, "roll_back"):
            def rolled(r, seq, end, *_):
                self._event("rollback", seq=_id(seq), end=end)
            self._wrap(sched, "roll_back", rolled)
        host = getattr(sched, "host", None)
        if host is not None:
            self._wrap(host, "swap_out", lambda r, blocks: self._event("swap_out", blocks=list(blocks), host=list(r)))
            self._wrap(host, "swap_in", lambda r, hb, blocks: self._event(
                "swap_in", host=list(hb), blocks=list(blocks[:len(hb)])))
        if hasattr(engine, "abort"):
            self._wrap(engine, "abort", lambda r, seqs: None, before=lambda seqs: self._aborting(seqs))

    def _watch_connectors(self, engine: Any) -> None:
        """L15: P's leases and D's pulls hold blocks between steps; see the docstring for their events."""
        producer, consumer = getattr(engine, "producer", None), getattr(engine, "consumer", None)
        if producer is not None:
            self._leasing: int | None = None  # the request engine.request_finished was called for
            self._wrap(engine, "request_finished", lambda r, seq: None,
                       before=lambda seq: setattr(self, "_leasing", _id(seq)))
            self._wrap(producer, "request_finished", self._leased)
            self._before_reap: dict[int, Any] = {}  # lease id -> its Lease, as reap began
            self._wrap(producer.leases, "reap", lambda r: self._reaped(producer.leases),
                       before=lambda: self._reaping(producer.leases))
        if consumer is not None:
            self._pulls: dict[int, int] = {}  # id(pending) -> its pull number, while in flight
            self._pull_count = 0
            self._wrap(consumer, "start", self._pull_started)
            failed = lambda: "refused" if consumer.policy == "fail" else "recompute"  # noqa: E731
            self._wrap(consumer, "finish", lambda r, pending: None,  # before: policy fail raises from finish
                       before=lambda pending: self._pull_ended(pending, failed() if pending.error else "filed"))
            self._wrap(consumer, "abandon", lambda r, pending: None,
                       before=lambda pending: self._pull_ended(pending, "abandoned"))

    # --- what happens ---

    def _event(self, op: str, **fields) -> None:
        if self._at is None and self.stamp is not None:
            self._at = self.stamp()
        self.events.append({"op": op, **fields})

    def _leased(self, params: dict, prompt_ids: list[int]) -> None:
        seq, self._leasing = self._leasing, None
        self._event("lease", lease=KEY_FORMAT.format(params["remote_request_id"]),
                    blocks=list(params["remote_block_ids"]), **({"seq": seq} if seq is not None else {}))

    def _reaping(self, leases: Any) -> None:
        with leases._lock:
            self._before_reap = dict(leases._leases)

    def _reaped(self, leases: Any) -> None:
        before, self._before_reap = self._before_reap, {}
        with leases._lock:
            left = set(leases._leases)
        for lease_id, lease in before.items():
            if lease_id not in left:  # reaped: released or, if not, expired
                self._event("unlease", lease=KEY_FORMAT.format(lease_id), blocks=list(lease.blocks),
                            why="released" if lease.released else "expired")

    def _pull_started(self, pending: Any, prompt_ids: list[int], params: dict) -> None:
        number = self._pulls[id(pending)] = self._pull_count
        self._pull_count += 1
        self._event("pull", pull=number, lease=KEY_FORMAT.format(params["remote_request_id"]),
                    blocks=[*pending.hits, *pending.fresh], hits=len(pending.hits), tokens=len(prompt_ids))

    def _pull_ended(self, pending: Any, outcome: str) -> None:
        number = self._pulls.pop(id(pending), None)
        if number is None:  # started before recording did: the header's ref counts cannot explain it either
            return
        self._event("pulled", pull=number, blocks=[*pending.hits, *pending.fresh], hits=len(pending.hits),
                    outcome=outcome, **({"error": pending.error} if pending.error else {}))

    def _aborting(self, seqs: list[Any]) -> None:
        live = [s for s in seqs if s.status.value != "finished"]
        for s in live:
            self.known.setdefault(_id(s), s)
        if live:
            self._event("abort", seqs=[_id(s) for s in live])

    def _plan(self, plan: list[Any]) -> None:
        self.plan = []
        for piece in plan:
            seq = getattr(piece, "seq", None) or piece  # L8 on: a slice of a sequence
            self.known.setdefault(_id(seq), seq)
            entry = {"seq": _id(seq), "from": piece.num_cached, "to": piece.num_tokens,
                     "decode": bool(getattr(piece, "decode", piece.num_cached == piece.num_tokens - 1
                                            and piece.num_cached > 0))}
            drafts = getattr(piece, "drafts", None)
            if drafts:
                entry["drafts"] = len(drafts)
            self.plan.append(entry)

    def _begin(self) -> None:
        if self.events:
            self._end("between")  # work done between steps: a server's abort (a table change without an event
            # would show in the next step's record, as its tables are diffed at its end)
        if self.stamp is not None:
            self._at = self.stamp()  # the step's record: when it began

    def _end(self, kind: str) -> None:
        for seq in live_sequences(self.engine):
            self.known.setdefault(_id(seq), seq)
        self.steps += kind == "step"
        record = {"kind": kind, "step": getattr(self.engine, "clock", self.steps), "plan": self.plan,
                  "events": self.events, **self._diff()}
        if self.stamp is not None:
            record["at"] = self._at if self._at is not None else self.stamp()
        self.events, self.plan, self._at = [], [], None
        self._write(record)

    def _changed(self) -> bool:
        return any(tuple(s.blocks) != self.tables.get(i, ()) for i, s in self.known.items())

    def _diff(self) -> dict:
        """The tables that changed since the last record, and every known sequence's status and lengths."""
        tables, host_tables, seqs = {}, {}, {}
        for i, s in list(self.known.items()):
            now = tuple(s.blocks)
            if now != self.tables.get(i, ()):
                tables[i] = list(now)
                self.tables[i] = now
            hb = tuple(getattr(s, "extra", {}).get("host_blocks", ()))
            if hb != self.host_tables.get(i, ()):
                host_tables[i] = list(hb)
                self.host_tables[i] = hb
            status = s.status.value if hasattr(s, "status") else ("finished" if not s.blocks else "running")
            info = (status, s.num_cached, s.num_tokens)
            if info != self.lengths.get(i):
                seqs[i] = {"status": status, "cached": s.num_cached, "tokens": s.num_tokens,
                           "prompt": len(s.prompt_ids) if s.prompt_ids else getattr(s, "prompt", 0), "ids": s.token_ids(0, s.num_tokens)
                           if i not in self.lengths else s.token_ids(self.lengths[i][2], s.num_tokens)}
                if i not in self.lengths:
                    seqs[i]["new"] = True
                self.lengths[i] = info
            if status == "finished":  # written once, then forgotten: a server records for days
                del self.known[i]
                self.tables.pop(i, None), self.host_tables.pop(i, None), self.lengths.pop(i, None)
        return {"tables": tables, "host_tables": host_tables, "seqs": seqs}

    # L2 and L3 have no step(): a forward is one. Its record closes when the forward returns, so it holds the
    # blocks reserved for it and, first, the frees of the requests that finished in the forward before.
    def _forward_l3(self, requests: list[Any]) -> None:
        for r in requests:
            if id(r) not in self.ids:
                self.ids[id(r)] = len(self.ids)
                r.seq_id = self.ids[id(r)]  # a plain attribute on L2's Request: the trace's name for it
            self.known.setdefault(r.seq_id, r)
        self._plan(requests)

    def _forward_l2(self, meta: Any) -> None:
        S = self.engine.block_size
        table = [int(s) // S for s in meta.kv_indices[::S].tolist()]
        req = self._l2
        if meta.is_prefill:
            if req is not None:  # L2 freed the last request's blocks before taking this one
                req.blocks, req.status = [], _Status("finished")
            req = self._l2 = _L2Request(seq_id=len(self.ids), prompt=int(meta.positions.numel()))
            self.ids[req.seq_id] = req.seq_id
            self.known[req.seq_id] = req
        req.blocks, req.num_cached, req.num_tokens = table, int(meta.positions[0]), int(meta.positions[-1]) + 1
        self.plan = [{"seq": req.seq_id, "from": req.num_cached, "to": req.num_tokens, "decode": not meta.is_prefill}]

    def close(self) -> None:
        """Write what is left (a last step, a free after it) and detach: the engine runs its own code again."""
        if self._l2 is not None and self.engine.allocator.num_free == self.engine.allocator.num_blocks:
            self._l2.blocks, self._l2.status = [], _Status("finished")  # L2 freed its last request after the forward
        if self.events or self._changed():
            self._end("between")
        for obj, name in reversed(self._undo):
            if name == "model":
                obj.model = obj.model.inner
            else:
                delattr(obj, name)
        self._undo.clear()
        self.out.flush()

    def _write(self, record: dict) -> None:
        self.out.write(json.dumps(record, separators=(",", ":")) + "\n")


class _Status:
    def __init__(self, value: str):
        self.value = value


class _L2Request:
    """L2's request as the trace sees it (L2's engine keeps its own inside generate()): lengths and blocks,
    no token ids (L2's forward metadata carries positions, not tokens)."""

    def __init__(self, seq_id: int, prompt: int):
        self.seq_id, self.blocks, self.num_cached, self.num_tokens, self.prompt = seq_id, [], 0, prompt, prompt
        self.prompt_ids: list[int] = []
        self.status = _Status("running")

    def token_ids(self, start: int, end: int) -> list[int]:
        return []


class _ModelProxy:
    """L2 calls its model directly; this stands in for it while recording and sees each forward's metadata."""

    def __init__(self, inner: Any, before: Callable[[Any], None], after: Callable[[], None]):
        self.inner, self.before, self.after = inner, before, after

    def __call__(self, tokens, positions, pool, meta):
        self.before(meta)
        hidden = self.inner(tokens, positions, pool, meta)
        self.after()
        return hidden

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@contextmanager
def record_engine(engine: Any, path: str | Path | None, lesson: str = "",
                  stamp: Callable[[], float] | None = None) -> Iterator[PoolRecorder | None]:
    """Record `engine` into `path` for the duration (None: record nothing, run as is)."""
    if path is None:
        yield None
        return
    with open(path, "w") as out:
        recorder = PoolRecorder(engine, out, lesson, stamp)
        try:
            yield recorder
        finally:
            recorder.close()


@contextmanager
def record_engines(engine_class: type, path: str | Path | None, lesson: str = "") -> Iterator[None]:
    """Record every `engine_class` (or subclass) built inside the block, and write the trace of the last one that
    ran a step to `path` (a script may build a throwaway engine to check its options, or run a plain engine
    first to have something to compare with). The class's __init__ is wrapped for the block's duration only."""
    if path is None:
        yield
        return
    own_init = engine_class.__dict__.get("__init__")
    recorders: list[tuple[PoolRecorder, io.StringIO]] = []

    def recording_init(self, *args, **kwargs):
        if own_init is not None:
            own_init(self, *args, **kwargs)
        else:
            super(engine_class, self).__init__(*args, **kwargs)
        out = io.StringIO()
        recorders.append((PoolRecorder(self, out, lesson), out))

    engine_class.__init__ = recording_init
    try:
        yield
    finally:
        if own_init is None:
            del engine_class.__init__
        else:
            engine_class.__init__ = own_init
        for recorder, _ in recorders:
            recorder.close()
        ran = [out.getvalue() for _, out in recorders if out.getvalue().count("\n") > 1]
        if ran:  # none here: the engine ran elsewhere (L9's smoke: in its server, which writes the trace itself)
            Path(path).write_text(ran[-1])


class Tee:
    """One recorder, two outputs (serve.py with --trace and --pool-viewer)."""

    def __init__(self, *outs: TextIO):
        self.outs = outs

    def write(self, line: str) -> int:
        for out in self.outs:
            out.write(line)
        return len(line)

    def flush(self) -> None:
        for out in self.outs:
            out.flush()


def read_trace(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

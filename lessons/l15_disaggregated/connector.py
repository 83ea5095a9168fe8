"""The KV connector, in vLLM's terms: the prefill engine's side leases a prompt's blocks and serves them; the decode
engine's side pulls the blocks its own prefix cache lacks and files them there.

  P  request_finished(prompt)   the prompt's full blocks (its prefix-cache entries) get one more reference under a
                                lease; the answer is the kv_transfer_params D needs (engine, lease, blocks, address)
     KvServer (a thread)         serves pulls of leased blocks over transfer.py's messages
     reap()                      on P's engine thread, between steps: frees the blocks of released or expired leases
  D  load(prompt, params)        its own hits first; then allocate the rest, pull them from P, register them in its
                                 prefix cache and tell P to release. The request is then admitted like any other:
                                 its prompt hits those blocks, and D feeds only the tail (at least one token, whose
                                 logits give the first output token), as after any prefix-cache hit (L6)

Only full blocks travel, because only full blocks are prefix-cache entries: D recomputes the last partial block's
tokens (fewer than one block). vLLM's NIXL connector moves the partial block too and recomputes one token.

Threads: P's pool is read by the server thread only in leased blocks, which nobody writes (a lease holds a
reference, and L6 copies a shared block before writing it); the allocator is touched only on P's engine thread.
"""
from __future__ import annotations

import itertools
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from lessons.l6_prefix_sharing.prefix_cache import chain_keys
from lessons.l10_tensor_parallel.wire import Malformed
from lessons.l14_batch_invariant import L14Engine
from lessons.l15_disaggregated.fingerprint import fingerprint
from lessons.l15_disaggregated.transfer import (
    MAX_BLOCKS,
    PageLayout,
    block_payload,
    check_layout,
    ints,
    layout_ints,
    receive,
    send,
    send_ints,
    write_block,
)
from shared.errors import CourseError

DEFAULT_LEASE_S = 30.0  # vLLM's kv_lease_duration default
DEFAULT_TIMEOUT_S = 10.0  # one socket operation; nothing waits forever
POLICIES = ("recompute", "fail")  # vLLM's kv_load_failure_policy


class TransferFailed(CourseError):
    """The pull did not complete and the policy is `fail`: the request is refused, nothing is left allocated."""


class NoRoom(CourseError):
    """D has too few free blocks for the pull: backpressure (try later), nothing changed."""


# Task L15.3: the prompt's cached full blocks: walk the hash chain through the prefix cache (L6's lookup)
def cached_prefix(engine: L14Engine, prompt_ids: list[int], most: int) -> tuple[list[int], list[int]]:
    """(the blocks of the longest cached prefix of the prompt, at most `most` of them; the chain keys of the
    prompt's first `most` blocks)."""
    S, cache = engine.block_size, engine.cache
    keys = chain_keys(prompt_ids, [], S, most, cache.hash_fn)
    blocks, parent = [], None
    for i, key in enumerate(keys):
        block = cache.lookup(key, parent, tuple(prompt_ids[i * S:(i + 1) * S]))
        if block is None:
            break
        blocks.append(block)
        parent = cache.ident(block)
    return blocks, keys


def transferable(prompt_len: int, block_size: int) -> int:
    """How many blocks travel: the full ones before the last prompt token (L6's match limit), so D always feeds
    at least that token."""
    return (prompt_len - 1) // block_size


@dataclass
class Lease:
    blocks: list[int]
    deadline: float
    readers: int = 0  # pulls reading its blocks now: it is not freed under them
    released: bool = False


class Leases:
    """P's leased blocks. Any thread grants, reads, releases; only the engine thread frees (reap)."""

    def __init__(self, duration_s: float, clock: Callable[[], float] = time.monotonic):
        self.duration_s, self.clock = duration_s, clock
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}

    def grant(self, blocks: list[int]) -> int:
        lease_id = secrets.randbits(62)  # unguessable: one client cannot pull another's prompt by counting
        with self._lock:
            self._leases[lease_id] = Lease(list(blocks), self.clock() + self.duration_s)
        return lease_id

    # Task L15.4: leases: blocks held for D until it releases them or the lease expires; freed on P's engine thread
    def start_read(self, lease_id: int) -> list[int] | None:
        """The lease's blocks, held until end_read; None if there is no such live lease."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.released or lease.deadline <= self.clock():
                return None
            lease.readers += 1
            return lease.blocks

    def end_read(self, lease_id: int) -> None:
        with self._lock:
            self._leases[lease_id].readers -= 1

    def release(self, lease_id: int) -> bool:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            lease.released = True
            return True

    # Task L15.4: leases: blocks held for D until it releases them or the lease expires; freed on P's engine thread
    def reap(self) -> list[list[int]]:
        """The block lists of every lease released or expired and not being read, forgotten here."""
        now, done = self.clock(), []
        with self._lock:
            for lease_id, lease in list(self._leases.items()):
                if (lease.released or lease.deadline <= now) and lease.readers == 0:
                    done.append(self._leases.pop(lease_id).blocks)
        return done

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)


class PrefillConnector:
    """P's side: lease a finished prompt's blocks, serve them, free them when D is done or the lease runs out."""

    def __init__(self, engine: L14Engine, host: str = "127.0.0.1", port: int = 0, lease_s: float = DEFAULT_LEASE_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self.engine, self.timeout_s = engine, timeout_s
        self.engine_id = f"{fingerprint(engine):016x}"
        self.layout = PageLayout.of(engine.runner.pool, fingerprint(engine))
        self.leases = Leases(lease_s, clock)
        self.server = KvServer(self, host, port)

    # Task L15.4: leases: blocks held for D until it releases them or the lease expires; freed on P's engine thread
    def request_finished(self, prompt_ids: list[int]) -> dict:
        """On P's engine thread, right after the prefill: one more reference to each full block of the prompt
        (the cached prefix), under a new lease; the kv_transfer_params D needs to pull them."""
        blocks, _ = cached_prefix(self.engine, prompt_ids, transferable(len(prompt_ids), self.engine.block_size))
        self.engine.allocator.share(blocks)
        lease_id = self.leases.grant(blocks)
        host, port = self.server.address
        return {"do_remote_prefill": True, "remote_engine_id": self.engine_id, "remote_request_id": lease_id,
                "remote_block_ids": blocks, "remote_host": host, "remote_port": port}

    # Task L15.4: leases: blocks held for D until it releases them or the lease expires; freed on P's engine thread
    def reap(self) -> int:
        """On P's engine thread: free the blocks of released and expired leases; how many leases ended."""
        ended = self.leases.reap()
        for blocks in ended:
            self.engine.allocator.free(blocks)
        return len(ended)

    def close(self) -> None:
        self.server.close()


class KvServer:
    """P's page server: one thread accepting on a loopback port, one short-lived thread per pull."""

    def __init__(self, connector: PrefillConnector, host: str, port: int):
        self.connector = connector
        self.listener = socket.create_server((host, port))
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.pulls = itertools.count()
        self._thread = threading.Thread(target=self._accept, name="kv-server", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name=f"kv-pull-{next(self.pulls)}", daemon=True).start()

    # Task L15.5: P serves a pull: the lease's blocks from the first D lacks, one message a block; then the release
    def _serve(self, conn: socket.socket) -> None:
        c = self.connector
        with conn:
            conn.settimeout(c.timeout_s)
            try:
                _, payload, _ = receive(conn, ("pull",), 16)
                lease_id, first = ints(payload, 2, "pull")
                blocks = c.leases.start_read(lease_id)
                if blocks is None or not 0 <= first <= len(blocks):
                    send(conn, "refused", b"no such lease: unknown, released or expired")
                    return
                try:
                    send_ints(conn, "layout", layout_ints(c.layout), count=len(blocks) - first)
                    for block in blocks[first:]:
                        send(conn, "block", block_payload(c.engine.runner.pool, block))
                finally:
                    c.leases.end_read(lease_id)
                _, payload, _ = receive(conn, ("release",), 8)
                c.leases.release(ints(payload, 1, "release")[0])
                send(conn, "release", payload, 1)  # the answer: released before D's pull returns; P's next step frees
            except (OSError, ConnectionError, Malformed):
                return  # D went away or sent nonsense: the lease stays until D pulls again or it expires

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way; close() alone would not
        except OSError:
            pass  # not connected: already shut
        self.listener.close()
        self._thread.join(timeout=5)


@dataclass
class LoadResult:
    hits: int  # full blocks D held already
    pulled: int  # full blocks pulled from P
    failed: str = ""  # why the pull failed (policy recompute: the request recomputes them)
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class PendingLoad:
    """A pull under way: D's blocks taken (hits shared, fresh ones allocated), not yet filled or registered."""

    prompt_ids: list[int]
    params: dict
    keys: list[int]
    hits: list[int]
    fresh: list[int]
    error: str = ""  # set by pull() when it fails
    bytes: int = 0
    began: float = field(default_factory=time.perf_counter)


class DecodeConnector:
    """D's side: pull what the prefix cache lacks, file it there, release P's lease. In three calls, so that a server
    can pull on another thread while its engine thread goes on stepping (vLLM's worker loads asynchronously too):
    start (engine thread: take blocks), pull (any thread: the network), finish (engine thread: register, free)."""

    def __init__(self, engine: L14Engine, policy: str = "recompute", timeout_s: float = DEFAULT_TIMEOUT_S):
        if policy not in POLICIES:
            raise CourseError(f"unknown kv load failure policy {policy!r}: use one of {', '.join(POLICIES)}")
        self.engine, self.policy, self.timeout_s = engine, policy, timeout_s
        self.layout = PageLayout.of(engine.runner.pool, fingerprint(engine))

    def load(self, prompt_ids: list[int], params: dict) -> LoadResult:
        """The three calls in a row: afterwards the request is admitted as usual and hits the pulled blocks."""
        pending = self.start(prompt_ids, params)
        self.pull(pending)
        return self.finish(pending)

    # Task L15.6: D's load: its own hits, then allocate, pull, register in its prefix cache, release; on failure free
    def start(self, prompt_ids: list[int], params: dict) -> PendingLoad:
        """Engine thread: D's own hits shared, the rest allocated. Raises NoRoom or CourseError, nothing changed."""
        remote = check_params(params, transferable(len(prompt_ids), self.engine.block_size))
        hits, keys = cached_prefix(self.engine, prompt_ids, len(remote))
        manager, want = self.engine.allocator, len(remote) - len(hits)
        revived = sum(1 for b in hits if manager.ref[b] == 0)
        if want + revived > manager.num_free:
            raise NoRoom(f"the decode engine has {manager.num_free} free blocks, the pull needs {want + revived}")
        manager.share(hits)  # first: alloc below must not evict the blocks just hit
        return PendingLoad(list(prompt_ids), params, keys, hits, manager.alloc(want))

    # Task L15.6: D's load: its own hits, then allocate, pull, register in its prefix cache, release; on failure free
    def pull(self, pending: PendingLoad) -> None:
        """Any thread: fill the fresh blocks from P and release its lease; a failure is kept in pending.error. With
        nothing to fill (D held every block) it only releases, and a failure to do so is no failure: the lease
        expires."""
        params, pool = pending.params, self.engine.runner.pool
        try:
            with socket.create_connection((params["remote_host"], params["remote_port"]), self.timeout_s) as conn:
                conn.settimeout(self.timeout_s)
                send_ints(conn, "pull", [params["remote_request_id"], len(pending.hits)])
                kind, payload, count = receive(conn, ("layout", "refused"), 8 * len(layout_ints(self.layout)))
                if kind == "refused":
                    raise ConnectionError(f"the prefill engine refused: {payload.decode(errors='replace')}")
                check_layout(payload, count, self.layout, len(pending.fresh))
                for block in pending.fresh:  # each block's length is checked against the layout before it is read
                    _, data, _ = receive(conn, ("block",), self.layout.block_bytes)
                    if len(data) != self.layout.block_bytes:
                        raise Malformed(f"a block of {len(data)} bytes, the layout says {self.layout.block_bytes}")
                    write_block(pool, block, data)
                    pending.bytes += len(data)
                send_ints(conn, "release", [params["remote_request_id"]])
                receive(conn, ("release",), 8)  # P's answer: the lease is marked released
        except (OSError, ConnectionError, Malformed) as e:
            if pending.fresh:
                pending.error = str(e) or type(e).__name__

    # Task L15.6: D's load: its own hits, then allocate, pull, register in its prefix cache, release; on failure free
    def finish(self, pending: PendingLoad) -> LoadResult:
        """Engine thread: register the pulled blocks in D's prefix cache and drop this load's references (they stay
        cached for the request's admission). On a failed pull the fresh blocks, never registered, go back to the
        free list; policy fail raises TransferFailed, recompute returns the reason (the prompt is recomputed)."""
        manager = self.engine.allocator
        if pending.error:
            manager.free(pending.hits + pending.fresh)
            params = pending.params
            if self.policy == "fail":
                raise TransferFailed(f"pulling the prompt's K/V from {params['remote_host']}:{params['remote_port']}"
                                     f" failed ({pending.error})")
            return LoadResult(len(pending.hits), 0, pending.error)
        self._register(pending)
        manager.free(pending.hits + pending.fresh)  # cached and unreferenced now: the request's admission hits them
        return LoadResult(len(pending.hits), len(pending.fresh), bytes=pending.bytes,
                          seconds=time.perf_counter() - pending.began)

    def abandon(self, pending: PendingLoad) -> None:
        """Engine thread, once pull() has returned (never during it: it writes into these blocks): the request went
        away (its client disconnected) while its pages were in flight. Its blocks are freed unregistered."""
        self.engine.allocator.free(pending.hits + pending.fresh)

    def _register(self, pending: PendingLoad) -> None:
        cache, S, ids = self.engine.cache, self.engine.block_size, pending.prompt_ids
        parent = cache.ident(pending.hits[-1]) if pending.hits else None
        for i, block in enumerate(pending.fresh, start=len(pending.hits)):
            tokens = tuple(ids[i * S:(i + 1) * S])
            cache.register(block, pending.keys[i], parent, tokens)
            found = cache.lookup(pending.keys[i], parent, tokens)  # ours, or a twin registered first (same K/V)
            parent = None if found is None else cache.ident(found)
            if parent is None:
                return  # the chain broke: the blocks after cannot be reached; they stay private and are freed


def check_params(params: object, most: int) -> list[int]:
    """kv_transfer_params as P wrote them, checked field by field before anything is allocated."""
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        raise CourseError("kv_transfer_params must be the prefill engine's answer, with do_remote_prefill: true")
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list) or not all(isinstance(b, int) and b >= 0 for b in blocks):
        raise CourseError("kv_transfer_params.remote_block_ids must be a list of block ids")
    if len(blocks) > min(most, MAX_BLOCKS):
        raise CourseError(f"kv_transfer_params names {len(blocks)} blocks; the prompt fills at most {most}")
    for name, kind in (("remote_request_id", int), ("remote_host", str), ("remote_port", int)):
        if not isinstance(params.get(name), kind) or isinstance(params.get(name), bool):
            raise CourseError(f"kv_transfer_params.{name} must be {'an integer' if kind is int else 'a string'}")
    if not 0 <= params["remote_request_id"] < 1 << 63:  # it travels as an int64
        raise CourseError(f"kv_transfer_params.remote_request_id {params['remote_request_id']} is no lease P gives")
    if not 1 <= params["remote_port"] <= 65535:
        raise CourseError(f"kv_transfer_params.remote_port {params['remote_port']} is not a TCP port")
    return blocks

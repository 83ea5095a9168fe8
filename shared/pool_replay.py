"""Rebuild the KV pool from a trace (`shared/pool_trace.py`), record by record, and say what each step did.

The replay knows only the trace. It applies the allocator's events as L2's allocator and L6's ref-counted
manager apply them (a block is handed out from the front of the free list, then the least recently released
cached one; a freed block goes to the back, a ref-counted free goes tail first), and after every record it
checks what must hold in any engine: each block's reference count is the number of block tables that name
it (L15: a lease on P and a pull in flight on D hold their blocks as a table does), and every block is exactly
one of free, cached and unreferenced, or held. A trace that breaks either
raises ReplayError naming the record and the block. tests/test_pool_trace.py checks the replay against the
engine's own state after every step of randomized workloads: the viewer's picture is the engine's.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


class ReplayError(ValueError):
    pass


SAY = {  # the events whose words need only their own fields (alloc, free and share show in the tables' changes)
    "cow": "copy-on-write: shared block {src} copied to block {dst} before a write into it",
    "evict": "block {block} evicted from the prefix cache to be reused",
    "register": "block {block} registered in the prefix cache ({tokens}-token prefix)",
    "swap_out": "swap out: device blocks {blocks} -> host blocks {host}",
    "swap_in": "swap in: host blocks {host} -> device blocks {blocks}",
    "fork": "request {seq} forks request(s) {children}: they share its blocks (ref counts rise)",
    "abort": "request(s) {seqs} aborted: their blocks return",
}


@dataclass
class SeqInfo:
    status: str = "waiting"
    cached: int = 0
    tokens: int = 0
    prompt: int = 0
    ids: list[int] = field(default_factory=list)


@dataclass
class PoolState:
    num_blocks: int
    block_size: int
    ref_counted: bool
    free: list[int]
    lru: list[int]
    ref: list[int]
    cache: dict[int, str]
    pinned: list[int]
    host_blocks: int = 0
    host_free: list[int] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)
    host_tables: dict[int, list[int]] = field(default_factory=dict)
    seqs: dict[int, SeqInfo] = field(default_factory=dict)
    leases: dict[str, list[int]] | None = None  # L15's P: lease id (hex) -> its blocks; None: not a P
    pulls: dict[int, list[int]] = field(default_factory=dict)  # L15's D: pull number -> its blocks, in flight
    record: int = 0  # records applied after the header

    @classmethod
    def from_header(cls, h: dict) -> "PoolState":
        if h.get("kind") != "header":
            raise ReplayError("a trace starts with its header line")
        state = cls(h["num_blocks"], h["block_size"], h["ref_counted"], list(h["free"]), list(h["lru"]),
                    list(h["ref"]), {int(b): k for b, k in h["cache"].items()}, list(h["pinned"]),
                    h["host_blocks"], list(h["host_free"]))
        if "leases" in h:
            state.leases = {k: list(b) for k, b in h["leases"].items()}
        state.check()
        return state

    def as_dict(self) -> dict:
        """What `pool_trace.pool_state(engine)` returns for the same pool (D's pulls in flight aside: the engine
        keeps no list of them)."""
        out = {"free": list(self.free), "lru": list(self.lru), "ref": list(self.ref), "cache": dict(self.cache),
               "tables": {i: list(t) for i, t in self.tables.items()}, "host_free": list(self.host_free),
               "host_tables": {i: list(t) for i, t in self.host_tables.items()}}
        if self.leases is not None:
            out["leases"] = {k: list(b) for k, b in self.leases.items()}
        return out

    def holders(self) -> dict[str, list[int]]:
        """L15: who holds blocks besides the tables, by name ("lease 3fa2c01b", "pull 0")."""
        return {**{f"lease {k[:8]}": list(b) for k, b in (self.leases or {}).items()},
                **{f"pull {n}": list(b) for n, b in self.pulls.items()}}

    # --- applying one record ---

    def apply(self, record: dict, check: bool = True) -> list[str]:
        """Apply one step's record; returns what happened, in words. check=False skips the whole-pool checks
        (a live server's viewer replays every poll; the tests check every record)."""
        self.record += 1
        before = {i: SeqInfo(**vars(s)) for i, s in self.seqs.items()}
        old_tables = {i: list(t) for i, t in self.tables.items()}
        old_holders = self.holders()
        for event in record["events"]:
            getattr(self, "_" + event["op"])(event)
        for i, blocks in record["tables"].items():
            self._set(self.tables, int(i), blocks)
        for i, blocks in record["host_tables"].items():
            self._set(self.host_tables, int(i), blocks)
        for i, info in record["seqs"].items():
            s = self.seqs.setdefault(int(i), SeqInfo())
            s.status, s.cached, s.tokens, s.prompt = info["status"], info["cached"], info["tokens"], info["prompt"]
            s.ids.extend(info["ids"])
        if check:
            self.check()
        return self.words(record, before, old_tables, old_holders)

    def forget_finished(self) -> None:
        """Drop the finished requests' records (a server's replay would otherwise grow with every request)."""
        for i in [i for i, s in self.seqs.items() if s.status == "finished"]:
            del self.seqs[i]

    @staticmethod
    def _set(tables: dict[int, list[int]], i: int, blocks: list[int]) -> None:
        if blocks:
            tables[i] = list(blocks)
        else:
            tables.pop(i, None)

    def _alloc(self, e: dict) -> None:
        if e["pool"] == "host":
            for b in e["blocks"]:
                self._expect(self.host_free and self.host_free[0] == b, f"host block {b} is not next on the free list")
                self.host_free.pop(0)
            return
        for b in e["blocks"]:
            if self.free:  # free blocks first, from the front
                self._expect(self.free[0] == b, f"block {b} handed out, but block {self.free[0]} is next on the free list")
                self.free.pop(0)
            else:  # then the least recently released cached block (its evict event came first)
                self._expect(self.lru and self.lru[0] == b, f"block {b} handed out, but it is not the next to evict")
                self._expect(b not in self.cache, f"block {b} reused while still in the prefix cache")
                self.lru.pop(0)
            self.ref[b] = 1

    def _free(self, e: dict) -> None:
        if e["pool"] == "host":
            self.host_free.extend(e["blocks"])
            return
        # L6's manager returns a table's references tail first; L2's allocator appends in order.
        for b in reversed(e["blocks"]) if self.ref_counted else e["blocks"]:
            self._expect(self.ref[b] > 0, f"block {b} freed but nobody holds it")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (self.lru if b in self.cache else self.free).append(b)

    def _share(self, e: dict) -> None:
        for b in e["blocks"]:
            if self.ref[b] == 0:
                self._expect(b in self.lru, f"block {b} shared but it is free, not cached")
                self.lru.remove(b)
            self.ref[b] += 1

    def _register(self, e: dict) -> None:
        self.cache[e["block"]] = e["key"]

    def _evict(self, e: dict) -> None:
        self._expect(e["block"] in self.cache, f"block {e['block']} evicted but it is not cached")
        del self.cache[e["block"]]

    def _noop(self, e: dict) -> None:
        """Events that only name what happened: their allocations and frees are events of their own."""

    _cow = _preempt = _fork = _rollback = _swap_out = _swap_in = _abort = _noop

    # L15: holders that are not tables. Their blocks' references are the share/alloc/free events around them.
    def _lease(self, e: dict) -> None:
        if self.leases is None:
            self.leases = {}
        self._expect(e["lease"] not in self.leases, f"lease {e['lease']} granted twice")
        self.leases[e["lease"]] = list(e["blocks"])

    def _unlease(self, e: dict) -> None:
        blocks = (self.leases or {}).pop(e["lease"], None)
        self._expect(blocks is not None, f"lease {e['lease']} ended but it was never granted")
        self._expect(blocks == e["blocks"], f"lease {e['lease']} ended with blocks {e['blocks']}, granted {blocks}")

    def _pull(self, e: dict) -> None:
        self._expect(e["pull"] not in self.pulls, f"pull {e['pull']} started twice")
        self.pulls[e["pull"]] = list(e["blocks"])

    def _pulled(self, e: dict) -> None:
        blocks = self.pulls.pop(e["pull"], None)
        self._expect(blocks is not None, f"pull {e['pull']} ended but it never started")
        self._expect(blocks == e["blocks"], f"pull {e['pull']} ended with blocks {e['blocks']}, took {blocks}")

    def _expect(self, ok: object, message: str) -> None:
        if not ok:
            raise ReplayError(f"record {self.record}: {message}")

    # --- what must hold after every record ---

    def check(self) -> None:
        held = Counter(b for t in self.tables.values() for b in t) + Counter(self.pinned)
        others = Counter(b for t in self.holders().values() for b in t)  # L15's leases and pulls in flight
        free, lru = set(self.free), set(self.lru)
        self._expect(len(free) == len(self.free) and len(lru) == len(self.lru), "a block is listed twice")
        for b in range(self.num_blocks):
            if self.ref[b] != held[b] + others[b]:
                also = f" and {others[b]} lease(s) or pull(s)" if others[b] else ""
                self._expect(False, f"block {b}: ref count {self.ref[b]} but {held[b]} table(s){also} hold it")
            where = (b in free) + (b in lru) + (self.ref[b] > 0)
            self._expect(where == 1, f"block {b} is in {where} of free, cached-unreferenced and held")
            self._expect(b not in free or b not in self.cache, f"block {b} is free but still in the prefix cache")
            self._expect(b not in lru or b in self.cache, f"block {b} waits for eviction but is not cached")
        self._expect(len(self.cache) == len(set(self.cache.values())), "two blocks share a prefix-cache key")

    # --- words ---

    def words(self, record: dict, before: dict[int, SeqInfo], old_tables: dict[int, list[int]],
              old_holders: dict[str, list[int]] | None = None) -> list[str]:
        out = []
        S = self.block_size
        for p in record["plan"]:
            i, n = p["seq"], p["to"] - p["from"]
            what = (f"decodes at position {p['from']}" if p["decode"] and not p.get("drafts")
                    else f"verifies {p['drafts']} draft token(s) after position {p['from']}" if p.get("drafts")
                    else f"prefills tokens {p['from']}..{p['to'] - 1} ({n})")
            out.append(f"request {i} {what}")
        changed = [(i, before.get(i, SeqInfo()), info) for i, info in sorted(self.seqs.items())
                   if before.get(i, SeqInfo()).status != info.status]  # first seen here: it was waiting before
        for i, was, info in changed:  # admissions, before what the step did with them
            if info.status == "running" and was.status == "waiting" and info.cached and i not in self._forked(record):
                hit = next((p["from"] for p in record["plan"] if p["seq"] == i), 0)
                if hit:
                    out.append(f"request {i} admitted with a prefix-cache hit: {hit} tokens ({hit // S} blocks) "
                               f"not computed again")
        for e in record["events"]:
            line = self._say(e, record["plan"])
            if line:
                out.append(line)
        for i, was, info in changed:  # then who finished
            if info.status == "finished" and not any(e["op"] == "abort" and i in e["seqs"] for e in record["events"]):
                out.append(f"request {i} finished: {info.tokens - info.prompt} tokens generated; its blocks return")
        for i in sorted(set(old_tables) | set(self.tables)):
            old, new = old_tables.get(i, []), self.tables.get(i, [])
            if old == new or not new:
                continue
            if new[:len(old)] == old:
                out.append(f"request {i}'s table grows by block(s) {new[len(old):]}")
            elif old[:len(new)] == new:
                out.append(f"request {i}'s table shrinks: block(s) {old[len(new):]} returned")
            elif old and len(old) <= len(new):
                swapped = [(a, b) for a, b in zip(old, new) if a != b]
                out.append(f"request {i}'s table: " + ", ".join(f"block {a} -> {b}" for a, b in swapped)
                           + (f", then + {new[len(old):]}" if len(new) > len(old) else ""))
            else:
                out.append(f"request {i}'s table is now {new}")
        for name, blocks in self.holders().items():  # L15: holders that outlive a record
            if name in (old_holders or {}):
                still = ("kept for the decode engine, not released yet" if name.startswith("lease")
                         else "held by no table, its pages in flight, not yet in the prefix cache")
                out.append(f"{name} still holds blocks {blocks}: {still}")
        return out

    @staticmethod
    def _forked(record: dict) -> set[int]:
        return {c for e in record["events"] if e["op"] == "fork" for c in e["children"]}

    @staticmethod
    def _say(e: dict, plan: list[dict]) -> str | None:
        op = e["op"]
        if op == "register" and e["tokens"] is None:  # after a parent entry that has left the cache
            return f"block {e['block']} registered in the prefix cache, after an evicted entry: never hit"
        if op in SAY:
            return SAY[op].format(**e)
        if op in ("lease", "unlease", "pull", "pulled"):
            return say_l15(e)
        if op == "preempt":
            return (f"request {e['seq']} preempted: its blocks copied to host memory" if e["to"] == "host" else
                    f"request {e['seq']} preempted: its blocks freed, its tokens to be computed again")
        if op == "rollback":
            p = next((p for p in plan if p["seq"] == e["seq"]), None)
            if p is None or not p.get("drafts"):
                return None  # a plain decode: nothing to roll back
            kept = e["end"] - p["from"] - 2  # the history gained kept drafts + the target's own token
            rest = "" if kept == p["drafts"] else f"; the {p['drafts'] - kept} rejected rolled back"
            return (f"request {e['seq']} kept {kept} of {p['drafts']} draft token(s) and the target's own{rest}: "
                    f"its cache holds {e['end'] - 1} tokens")
        return None


def say_l15(e: dict) -> str:
    """L15's holders in words: P's leases, D's pulls."""
    op, blocks = e["op"], e["blocks"]
    if op == "lease":
        who = f"request {e['seq']}" if "seq" in e else "a finished prompt"
        if not blocks:
            return f"{who}: no full block to lease (lease {e['lease'][:8]} holds nothing)"
        return (f"{who}: blocks {blocks} leased to the decode engine (lease {e['lease'][:8]}; each ref +1, held "
                f"until it pulls them or the lease expires)")
    if op == "unlease":
        why = "released by the decode engine" if e["why"] == "released" else "expired before a pull released it"
        return f"lease {e['lease'][:8]} {why}: blocks {blocks} let go (each ref -1)"
    hits, fresh = blocks[:e["hits"]], blocks[e["hits"]:]
    if op == "pull":
        own = f"; block(s) {hits} this engine's own cache held already" if hits else ""
        return (f"pull {e['pull']} (lease {e['lease'][:8]}, a {e['tokens']}-token prompt): blocks {fresh} taken to "
                f"be filled from the prefill engine{own}")
    outcome, why = e["outcome"], f" ({e['error']})" if e.get("error") else ""
    if outcome == "filed":
        return (f"pulled {len(fresh)} block(s) from the prefill engine into {fresh}; they enter the prefix cache, "
                f"where the request's admission hits them")
    if outcome == "abandoned":
        return f"pull {e['pull']} abandoned (its client left): blocks {blocks} freed, {fresh} unregistered"
    then = ("the request is refused (policy fail)" if outcome == "refused"
            else "the prompt is computed here instead (policy recompute)")
    return f"pull {e['pull']} failed{why}: blocks {blocks} freed, {fresh} unregistered; {then}"


def replay(trace: list[dict]) -> list[tuple[dict, PoolState, list[str]]]:
    """Every record of a trace with the pool after it and its words (the state objects are copies)."""
    import copy

    state = PoolState.from_header(trace[0])
    out = []
    for record in trace[1:]:
        words = state.apply(record)
        out.append((record, copy.deepcopy(state), words))
    return out

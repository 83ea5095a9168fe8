"""The pool viewer, live: a running server's trace, kept in memory, and two read-only routes that draw it.

`serve.py --pool-viewer` attaches a recorder (shared/pool_trace.py) to the engine with a LivePool as its output.
The engine thread only appends each record's line (and, past `keep` records, folds the oldest into the pool
it started from); the routes replay in FastAPI's worker threads, never on the event loop, and change nothing.
GET /pool is the page (shared/pool_page.py); it polls GET /pool/frames?after=N for the frames after N.
"""
from __future__ import annotations

import copy
import json
import threading
from collections import deque
from typing import Callable

from shared.pool_page import frame_of, render
from shared.pool_replay import PoolState

KEEP = 300  # records the server keeps: the page's slider reaches this far back
MOST = 100  # frames one poll returns at most (the newest): a large pool's frame is tens of kilobytes


class LivePool:
    def __init__(self, keep: int = KEEP, decode: Callable[[int], str] | None = None):
        self.keep, self.decode = keep, decode  # decode: a token id's text, for the page's hover
        self.pieces: dict[int, str] = {}
        self.lock = threading.Lock()
        self.header: dict | None = None
        self.base: PoolState | None = None  # the pool before records[0]
        self.records: deque[str] = deque()
        self.first = 0  # the index of records[0] among every record since the server started

    def write(self, line: str) -> int:
        """The recorder's output (the engine thread): keep the line; fold the oldest into the base."""
        with self.lock:
            if self.base is None:
                self.header = json.loads(line)
                self.base = PoolState.from_header(self.header)
                return len(line)
            self.records.append(line)
            if len(self.records) > self.keep:
                self.base.apply(json.loads(self.records.popleft()), check=False)
                self.base.forget_finished()
                self.first += 1
        return len(line)

    def flush(self) -> None:
        pass

    def frames(self, after: int = -1, most: int = MOST) -> dict:
        """The frames after index `after` (at most `most`, the newest), and the requests they show."""
        with self.lock:
            if self.base is None:
                return {"frames": [], "next": 0, "seqs": {}}
            state, lines, first = copy.deepcopy(self.base), list(self.records), self.first
        out = []
        start = max(after + 1, first + len(lines) - most)
        for index, line in enumerate(lines, start=first):
            record = json.loads(line)
            words = state.apply(record, check=False)
            if index >= start:
                out.append({**frame_of(state, record, words), "index": index})
        seqs = {str(i): {"prompt": s.prompt, "ids": s.ids} for i, s in state.seqs.items()}
        pieces = {}
        if self.decode is not None:
            for s in state.seqs.values():
                for t in s.ids:
                    if t not in self.pieces:
                        self.pieces[t] = self.decode(t)  # at most the vocabulary, once each
                    pieces[str(t)] = self.pieces[t]
        return {"frames": out, "next": first + len(lines), "seqs": seqs, "pieces": pieces}

    def page(self, live_url: str) -> str:
        h = self.header or {}
        data = {"title": "live pool", "lesson": h.get("lesson", ""), "engine": h.get("engine", ""),
                "kv_role": h.get("kv_role", ""),
                "num_blocks": h.get("num_blocks", 0), "block_size": h.get("block_size", 0),
                "ref_counted": h.get("ref_counted", False), "host_blocks": h.get("host_blocks", 0),
                "pinned": h.get("pinned", []), "seqs": {}, "pieces": {}, "frames": [], "live": live_url}
        return render(data)


def add_routes(app, live: LivePool, path: str = "/pool") -> None:
    """GET {path}: the page; GET {path}/frames?after=N: new frames as JSON. Plain `def` handlers: FastAPI runs
    them in its worker threads, so a replay never holds up the event loop."""
    from fastapi.responses import HTMLResponse, JSONResponse

    @app.get(path, response_class=HTMLResponse, include_in_schema=False)
    def pool_page() -> HTMLResponse:
        return HTMLResponse(live.page(f"{path}/frames"))

    @app.get(f"{path}/frames", include_in_schema=False)
    def pool_frames(after: str = "-1") -> JSONResponse:
        try:
            index = int(after)
        except ValueError:
            index = -2
        if index < -1:  # shaped as the server's every other refusal (OpenAI's error object)
            return JSONResponse({"error": {"message": f"after must be an integer of at least -1, got {after!r}",
                                           "type": "invalid_request_error", "param": "after", "code": None}}, 400)
        return JSONResponse(live.frames(index))

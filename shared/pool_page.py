"""The pool viewer's page: a trace, replayed (`shared/pool_replay.py`), as one self-contained HTML file.

The page draws frames; it never replays anything itself. Each frame is the replay's pool after one record
(frame 0: the pool when recording began): every block table, reference counts, the free list, the blocks
cached and unreferenced, the prefix cache's keys, each request's status and lengths, and the step's events in
words. The HTML, CSS and script are in `pool_viewer.html` beside this file; the data goes into it as JSON.
No network, no build step: open the file.

L15 has two pools, the prefill engine's and the decode engine's: `render_panes` puts one such page per trace side
by side (`pool_panes.html`, each page in an iframe with its own slider), and when every record carries "at"
(pool_trace.py stamps L15's) one more slider above them steps both together in the order things happened.
A frame of L15's also lists the holders that are not tables: P's leases, D's pulls in flight.
"""
from __future__ import annotations

import json
from pathlib import Path

from shared.pool_replay import PoolState

TEMPLATE = Path(__file__).with_name("pool_viewer.html")
PANES_TEMPLATE = Path(__file__).with_name("pool_panes.html")
DATA_MARK = "/*POOL_DATA*/null"
ROLES = {"kv_producer": "prefill engine P", "kv_consumer": "decode engine D"}  # L15's, for titles


def frame_of(state: PoolState, record: dict | None, words: list[str]) -> dict:
    """One frame: the pool after a record, and what the record did (the blocks it touched, for highlights)."""
    touched: dict[str, list[int]] = {"alloc": [], "free": [], "cow": [], "evict": [], "register": [], "share": []}
    for e in (record or {}).get("events", []):
        op = e["op"]
        if op in ("alloc", "free") and e.get("pool") == "device":
            touched[op] += e["blocks"]
        elif op == "share":
            touched["share"] += e["blocks"]
        elif op == "cow":
            touched["cow"].append(e["dst"])
        elif op in ("evict", "register"):
            touched[op].append(e["block"])
    frame = {
        "step": record["step"] if record else 0,
        "kind": record["kind"] if record else "start",
        "plan": record["plan"] if record else [],
        "words": words,
        "tables": {str(i): t for i, t in state.tables.items()},
        "host_tables": {str(i): t for i, t in state.host_tables.items()},
        "ref": list(state.ref), "free": list(state.free), "lru": list(state.lru),
        "cache": {str(b): k for b, k in state.cache.items()},
        "host_free": list(state.host_free),
        "status": {str(i): {"status": s.status, "cached": s.cached, "tokens": s.tokens}
                   for i, s in state.seqs.items() if s.status != "finished" or str(i) in (record or {}).get("seqs", {})},
        "touched": touched,
    }
    if state.leases is not None or state.pulls:  # L15: the blocks' holders that are not tables
        frame["holders"] = state.holders()
    return frame


def page_data(trace: list[dict], title: str = "", pieces: dict[int, str] | None = None) -> dict:
    """Everything the page shows, from a trace: the header, each request's tokens, one frame per record."""
    header = trace[0]
    state = PoolState.from_header(header)
    frames = [frame_of(state, None, ["recording starts: the pool as it was"])]
    for record in trace[1:]:
        words = state.apply(record)
        frames.append(frame_of(state, record, words))
    for frame, record in zip(frames, trace):
        if "at" in record:  # L15: when it happened, to step two engines' pages together
            frame["at"] = record["at"]
    role = ROLES.get(header.get("kv_role", ""))
    return {
        "title": title or f"{header['lesson'].upper()} pool" + (f", {role}" if role else ""),
        "lesson": header["lesson"], "engine": header["engine"], "kv_role": header.get("kv_role", ""),
        "num_blocks": header["num_blocks"], "block_size": header["block_size"],
        "ref_counted": header["ref_counted"], "host_blocks": header["host_blocks"], "pinned": header["pinned"],
        "seqs": {str(i): {"prompt": s.prompt, "ids": s.ids} for i, s in state.seqs.items()},
        "pieces": {str(t): p for t, p in (pieces or {}).items()},
        "frames": frames,
    }


def render(data: dict) -> str:
    """The page with its data inside. `</` is escaped so no token text can end the script element."""
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    html = TEMPLATE.read_text()
    if DATA_MARK not in html:
        raise RuntimeError(f"{TEMPLATE} has lost its data mark {DATA_MARK!r}")
    return html.replace(DATA_MARK, blob)


def render_panes(pages: list[dict], title: str = "") -> str:
    """Several pages side by side (L15: P's and D's), each whole in its own iframe; a slider over all of them when
    every frame carries "at". The pages go in as JSON strings with every `<` escaped: each page holds `<script>`
    and `<!--`, which inside the outer script element could change how HTML reads it, not only `</`."""
    panes = [{"title": data["title"], "html": render(data), "at": [f.get("at") for f in data["frames"]]}
             for data in pages]
    data = {"title": title or " · ".join(d["title"] for d in pages), "panes": panes}
    blob = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    html = PANES_TEMPLATE.read_text()
    if DATA_MARK not in html:
        raise RuntimeError(f"{PANES_TEMPLATE} has lost its data mark {DATA_MARK!r}")
    return html.replace(DATA_MARK, blob)

"""GET /health again and again in a process of its own, so the latency measured is the server's alone.

    python scripts/benchmark/health_probe.py BASE_URL INTERVAL_S START_EPOCH END_EPOCH GRACE_S

l9_responsiveness.py starts it before its window opens: it waits for START_EPOCH (time.time()), then sends one
GET at a time, each INTERVAL_S after the last began, until END_EPOCH; a probe still unanswered GRACE_S later
counts as a failure with its wait so far. It prints one JSON line: {"ms": [latencies], "failures": N}. In the
load generator's own event loop the probe waited behind 32 streams' chunks (the loop lagged 14 ms at p99).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.cli import OneLineParser  # noqa: E402


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="health_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the server's root URL, e.g. http://127.0.0.1:8000")
    for name in ("interval", "start", "end", "grace"):
        p.add_argument(name, type=float, help={"interval": "seconds between probes' starts",
                                               "start": "time.time() to begin at", "end": "time.time() to stop at",
                                               "grace": "seconds a probe may wait for its answer"}[name])
    args = p.parse_args(argv)
    base, interval, start, end, grace = args.base, args.interval, args.start, args.end, args.grace
    latencies, failures = [], 0
    with httpx.Client(base_url=base, timeout=grace) as client:
        time.sleep(max(0.0, start - time.time()))
        while time.time() < end:
            t = time.perf_counter()
            ok = False
            try:
                ok = client.get("/health").status_code == 200
            except httpx.HTTPError:
                pass
            latencies.append((time.perf_counter() - t) * 1e3)
            failures += not ok
            time.sleep(max(0.0, t + interval - time.perf_counter()))
    print(json.dumps({"ms": latencies, "failures": failures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

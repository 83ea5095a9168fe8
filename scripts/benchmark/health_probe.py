"""GET /health again and again in a process of its own, so the latency measured is the server's alone.

    python scripts/benchmark/health_probe.py BASE_URL INTERVAL_S DURATION_S GRACE_S

l9_responsiveness.py starts it and waits for its first line: once started up it sends one GET and, when that is
answered, prints `ready` (a GET that fails, or none answered within GRACE_S, exits 1 with one line instead). It
then opens its window at once, and the load generator starts its load on reading that line: whatever the box's
speed, the load never starts before the probe can probe. For DURATION_S seconds it sends one GET at a time, each
INTERVAL_S after the last began (the first at once, so a window always holds one); a probe still unanswered
GRACE_S later counts as a failure with its wait so far. It prints one JSON line: {"ms": [latencies],
"failures": N}; the first GET (an idle server and a new connection) is not among them. In the load generator's
own event loop the probe waited behind 32 streams' chunks (the loop lagged 14 ms at p99).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.cli import OneLineParser  # noqa: E402

READY = "ready"  # the first line printed, once the first GET has been answered


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="health_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the server's root URL, e.g. http://127.0.0.1:8000")
    for name in ("interval", "duration", "grace"):
        p.add_argument(name, type=float, help={"interval": "seconds between probes' starts",
                                               "duration": "seconds the window lasts, from the ready line",
                                               "grace": "seconds a probe may wait for its answer"}[name])
    args = p.parse_args(argv)
    base, interval, duration, grace = args.base, args.interval, args.duration, args.grace
    latencies, failures = [], 0
    with httpx.Client(base_url=base, timeout=grace) as client:
        try:  # before any load: opens the connection and proves the server answers this process
            status = client.get("/health").status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        if status != 200:
            print(f"error: the first GET {base}/health got {status}", file=sys.stderr)
            return 1
        print(READY, flush=True)
        end = time.perf_counter() + duration
        while True:  # the test at the bottom: a window always holds its first probe, however late it began
            t = time.perf_counter()
            ok = False
            try:
                ok = client.get("/health").status_code == 200
            except httpx.HTTPError:
                pass
            latencies.append((time.perf_counter() - t) * 1e3)
            failures += not ok
            if t + interval >= end:  # the next probe would start after the window closed
                break
            time.sleep(max(0.0, t + interval - time.perf_counter()))
    print(json.dumps({"ms": latencies, "failures": failures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

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

import httpx


def main(argv: list[str]) -> int:
    base, interval, start, end, grace = argv[0], float(argv[1]), float(argv[2]), float(argv[3]), float(argv[4])
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

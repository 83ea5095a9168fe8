"""L9's server under hostile load (issue 27): does GET /health stay quick, and do streams keep flowing, while
huge and malformed requests arrive? Optionally against an older tree's server too, in the same run.

    OMP_NUM_THREADS=1 python scripts/benchmark/l9_responsiveness.py [--before REF] [--duration 20] [--clients 32]
        [--max-tokens 64] [--hostile-interval 0.25] [--probe-interval 0.01] [--threads 1] [--model DIR] [--json PATH]

Each server (REF's first when --before is given: a temporary `git worktree` of REF, removed at the end, whose
scripts/serve.py runs with this Python; then this tree's) starts alone with --threads (one core for the server,
the other for this client), answers one warm-up request, and then for --duration seconds gets, from one asyncio
process with httpx:
  - --clients streaming clients, each looping a streaming /v1/completions request (--max-tokens tokens,
    end-of-sequence ignored); every gap between two consecutive chunks that carry text is an inter-token gap;
  - hostile requests (none with --hostile-interval 0: the baseline), one at a time, one every
    --hostile-interval seconds, cycling through: a prompt string filling the body to just under the 1 MiB
    limit, the longest prompt the server cannot refuse untokenized (within the context at 128 bytes a
    token, but over it in tokens), a prompt of token IDs as large as the first, 5,000 levels of nested
    arrays in an unknown field, and fields of the wrong types; their status codes are counted (5xx apart);
  - a probe, in a process of its own (health_probe.py, so this client's event loop adds no lag to it): GET
    /health every --probe-interval seconds, one at a time, each latency kept. The load starts only once the
    probe's first GET has been answered (at most 30 s after its start, or the run stops with one line).
Reported per server: /health p50/p99/max, every stream's worst gap (max and p99 over streams), tokens/s (chunks
that carry text; with end-of-sequence ignored each carries about one token), the hostile status counts and each
kind's median latency, and the client's own CPU share and event-loop lag (a lag near /health's latency means
the client, not the server, is slow). The start, load and stop times of each server are printed as they pass.
Target (a benchmark, not a test): /health p99 <= 20 ms and max <= 100 ms under this load.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import torch
from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness
sys.path.insert(0, str(ROOT))
import harness  # noqa: E402
from health_probe import READY  # noqa: E402
from lessons.l9_server.app import MAX_BODY_BYTES  # noqa: E402
from shared.server_process import SERVE, ServerProcess  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

HEALTH_P99_MS, HEALTH_MAX_MS = 20.0, 100.0
NESTING = 5000
GRACE_S = 10.0  # for the last probe and hostile request after the deadline
LONGEST_TOKEN_BYTES = 128  # Qwen3's longest token, 128 spaces: a text of B bytes is at least B / 128 tokens
PROMPT = "The quick brown fox jumps over the lazy dog, and then"


def hostile_bodies(model: str, limit: int, context: int) -> list[tuple[str, bytes]]:
    """(kind, body): each is refused by a correct server with a 4xx; none should slow anyone else down."""
    head = {"model": model, "max_tokens": 1}
    room = limit - len(json.dumps(head)) - 64  # just under the limit, with room for the field's name
    text = json.dumps({**head, "prompt": "the " * (room // 4)})
    # Past the context in tokens, but within it at 128 bytes a token (the longest Qwen3 token): only the
    # tokenizer can refuse it, after the longest work an admissible prompt costs.
    admitted = json.dumps({**head, "prompt": "the " * (min(room, (context - 1) * LONGEST_TOKEN_BYTES) // 4 - 1)})
    ids = json.dumps({**head, "prompt": [1] * (room // 3)})  # "1, " per token ID
    nested = json.dumps({**head, "prompt": "hi"})[:-1] + ', "x": ' + "[" * NESTING + "]" * NESTING + "}"
    bad = json.dumps({**head, "prompt": 5, "max_tokens": "many", "temperature": "hot"})
    return [(kind, body.encode()) for kind, body in
            (("1 MiB text prompt", text), ("tokenized, then too long", admitted), ("1 MiB token-ID prompt", ids),
             (f"{NESTING}-deep JSON", nested), ("bad fields", bad))]


@dataclass
class Measured:
    duration_s: float = 0.0
    probe_ms: list[float] = field(default_factory=list)
    probe_failures: int = 0
    worst_gap_ms: list[float] = field(default_factory=list)  # one per stream that produced two text chunks
    text_chunks: int = 0
    streams_done: int = 0
    stream_errors: Counter = field(default_factory=Counter)
    hostile: dict[str, Counter] = field(default_factory=dict)  # kind -> status -> count
    hostile_ms: dict[str, list[float]] = field(default_factory=dict)  # kind -> each one's latency
    client_cpu: float = 0.0  # this process's CPU seconds per wall second
    lag_ms: list[float] = field(default_factory=list)  # the client event loop's lateness on 5 ms sleeps


def outcome(e: BaseException) -> str:
    return str(e.response.status_code) if isinstance(e, httpx.HTTPStatusError) else type(e).__name__


async def streamer(client: httpx.AsyncClient, body: dict, deadline: float, m: Measured) -> None:
    while time.perf_counter() < deadline:
        last, worst = None, 0.0
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
                        now = time.perf_counter()
                        if last is not None:
                            worst = max(worst, now - last)
                        last = now
                        m.text_chunks += 1
            m.streams_done += 1
        except (httpx.HTTPError, ValueError) as e:
            m.stream_errors[outcome(e)] += 1
            await asyncio.sleep(0.1)  # a refusing server is not hammered in a tight loop
        finally:  # also when cancelled at the deadline, mid-stream: its gaps so far count
            if worst:
                m.worst_gap_ms.append(worst * 1e3)


async def hostile(client: httpx.AsyncClient, bodies: list[tuple[str, bytes]], interval: float, deadline: float,
                  m: Measured) -> None:
    t, i = time.perf_counter(), 0
    while time.perf_counter() < deadline:
        kind, body = bodies[i % len(bodies)]
        sent = time.perf_counter()
        try:
            status = str((await client.post("/v1/completions", content=body,
                                            headers={"content-type": "application/json"})).status_code)
        except httpx.HTTPError as e:
            status = outcome(e)
        except asyncio.CancelledError:  # still unanswered GRACE_S after the deadline
            status = "unanswered"
            raise
        finally:
            m.hostile.setdefault(kind, Counter())[status] += 1
            m.hostile_ms.setdefault(kind, []).append((time.perf_counter() - sent) * 1e3)
        i, t = i + 1, t + interval
        await asyncio.sleep(max(0.0, min(t, deadline) - time.perf_counter()))


PROBE = Path(__file__).resolve().parent / "health_probe.py"
# Its start-up (Python and httpx imports: seconds on a slow box) and first GET (at most GRACE_S): a probe not
# ready by then is stuck, and the run stops with one line rather than wait for it.
PROBE_READY_S = 30.0
PROBE_EXIT_S = 2.0  # after its last answer: the probe's JSON line and exit


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with suppress(ProcessLookupError):  # it exited between the test and the kill
            proc.kill()
    await proc.wait()


async def start_probe(base: str, interval: float, duration: float) -> asyncio.subprocess.Process:
    """The /health probe in a process of its own (health_probe.py): this process's event loop, busy with every
    stream's chunks, would add its own lag to each latency. Returns once its first GET has been answered (its
    window opens then), so no load starts before it can probe, however slowly it started."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(PROBE), base, str(interval), str(duration), str(GRACE_S),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=PROBE_READY_S)
    except asyncio.TimeoutError:
        await stop(proc)
        raise RuntimeError(f"the /health probe was not ready within {PROBE_READY_S:g} s") from None
    if line.decode().strip() != READY:  # it exited (its stdout closed) or printed something else
        await stop(proc)
        err = await proc.stderr.read()
        said = (err.decode().strip().splitlines() or [line.decode().strip() or "nothing"])[-1]
        raise RuntimeError(f"the /health probe was not ready: {said}")
    return proc


async def probe_result(proc: asyncio.subprocess.Process, duration: float, m: Measured) -> None:
    """The probe's latencies, once it has run its window and answered its last probe."""
    out, err = await asyncio.wait_for(proc.communicate(), timeout=duration + GRACE_S + PROBE_EXIT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"the /health probe exited with status {proc.returncode}: {err.decode()[-300:]}")
    found = json.loads(out)
    m.probe_ms, m.probe_failures = found["ms"], found["failures"]


async def lag(deadline: float, m: Measured) -> None:
    while (t := time.perf_counter()) < deadline:
        await asyncio.sleep(0.005)
        m.lag_ms.append((time.perf_counter() - t - 0.005) * 1e3)


async def load(base: str, model: str, context: int, args) -> Measured:
    m = Measured()
    prober: asyncio.subprocess.Process | None = None
    clients = [httpx.AsyncClient(base_url=base, timeout=30, limits=httpx.Limits(max_connections=None))
               for _ in range(2)]  # streams, hostile: neither waits for the other's connection
    body = {"model": model, "prompt": PROMPT, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    try:
        warm = await clients[0].post("/v1/completions", json={**body, "max_tokens": 8, "stream": False})
        if warm.status_code != 200:
            raise RuntimeError(f"the warm-up request got HTTP {warm.status_code}: {warm.text[:200]}")
        prober = await start_probe(base, args.probe_interval, args.duration)  # its window has just opened
        t0, cpu0 = time.perf_counter(), time.process_time()
        deadline = t0 + args.duration
        streams = [asyncio.create_task(streamer(clients[0], body, deadline, m)) for _ in range(args.clients)]
        others = [asyncio.create_task(probe_result(prober, args.duration, m)), asyncio.create_task(lag(deadline, m))]
        if args.hostile_interval > 0:  # 0: none, the baseline the hostile load is judged against
            others.append(asyncio.create_task(hostile(clients[1], hostile_bodies(model, MAX_BODY_BYTES, context),
                                                      args.hostile_interval, deadline, m)))
        await asyncio.sleep(args.duration)
        for task in streams:  # cut mid-stream at the deadline: tokens/s counts the window only
            task.cancel()
        m.duration_s = time.perf_counter() - t0
        m.client_cpu = (time.process_time() - cpu0) / m.duration_s
        await asyncio.wait(others, timeout=GRACE_S + PROBE_EXIT_S)  # the probe's and hostile's last requests finish
        for task in streams + others:
            task.cancel()
        results = await asyncio.gather(*streams, *others, return_exceptions=True)
        probe_outcome = results[len(streams)]
        if isinstance(probe_outcome, BaseException):  # no latencies: say why instead of reporting none
            raise RuntimeError(f"the /health probe gave no result: {probe_outcome!r}")
    finally:
        if prober is not None:
            await stop(prober)
        for c in clients:
            await c.aclose()
    return m


# ----- the servers -----

def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if done.returncode:
        raise CourseError(f"git {' '.join(args)}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
    return done.stdout.strip()


@contextmanager
def tree(ref: str | None) -> Iterator[tuple[str, Path]]:
    """(label, serve.py): REF's, from a temporary worktree removed afterwards; or this tree's (ref None)."""
    if ref is None:
        yield f"after: this tree ({harness.commit(['scripts/serve.py'])})", SERVE  # dirty as the harness counts it
        return
    with tempfile.TemporaryDirectory(prefix="l9_before_") as tmp:
        path = Path(tmp) / "tree"
        git("worktree", "add", "--detach", str(path), ref)
        try:
            yield f"before: {ref} ({git('rev-parse', '--short', ref + '^{commit}')})", path / "scripts" / "serve.py"
        finally:
            git("worktree", "remove", "--force", str(path))


def measure(serve: Path, model_dir: Path, args, console: Console, label: str) -> tuple[Measured, str]:
    """One server, started alone, under the whole load; (what was measured, the attention backend it used)."""
    server = ServerProcess(["--model", str(model_dir), "--device", "cpu", "--host", "127.0.0.1"], args.threads,
                           serve=serve)
    t0 = time.perf_counter()
    with server:
        t1 = time.perf_counter()
        context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
        m = asyncio.run(load(server.url.removesuffix("/v1"), server.model, context, args))
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server died under the load: {server.stderr_tail()}")
        t2 = time.perf_counter()
    console.print(f"  {label}: started in {t1 - t0:.0f} s, loaded for {t2 - t1:.0f} s (warm-up and the last hostile "
                  f"request included), stopped in {time.perf_counter() - t2:.0f} s")
    # The backend serve.py says its engine runs; an older tree's serve.py did not say, but warned on a fallback.
    fell_back = "C++ attention kernel is unavailable" in server.log_text()
    return m, server.engine().get("backend") or ("batched (no C++ kernel)" if fell_back else "cpp")


# ----- the report -----

def summary(m: Measured) -> dict[str, float]:
    def pct(xs: list[float], q: float) -> float:
        return harness.percentiles(xs, (q,))[f"p{q:g}"] if xs else float("nan")

    statuses = sum((c for c in m.hostile.values()), Counter())
    return {"/health p50 (ms)": pct(m.probe_ms, 50), "/health p99 (ms)": pct(m.probe_ms, 99),
            "/health max (ms)": max(m.probe_ms, default=float("nan")), "probes": len(m.probe_ms),
            "probe failures": m.probe_failures, "worst gap, max over streams (ms)": max(m.worst_gap_ms, default=0.0),
            "worst gap, p99 over streams (ms)": pct(m.worst_gap_ms, 99), "tokens/s": m.text_chunks / m.duration_s,
            "streams completed": m.streams_done, "stream errors": sum(m.stream_errors.values()),
            "hostile requests": sum(statuses.values()),
            "hostile 5xx or no answer": sum(n for s, n in statuses.items() if not s.isdigit() or int(s) >= 500),
            "client CPU (% of a core)": 100 * m.client_cpu, "client loop lag p99 (ms)": pct(m.lag_ms, 99),
            "client loop lag max (ms)": max(m.lag_ms, default=0.0)}


def show(console: Console, results: dict[str, tuple[Measured, str]]) -> dict[str, dict]:
    sums = {label: summary(m) for label, (m, _) in results.items()}
    rows = []
    for name in next(iter(sums.values())):
        values = [s[name] for s in sums.values()]
        cells = [f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" for v in values]
        if len(values) == 2:
            cells.append(f"{values[1] / values[0]:.2f}x" if values[0] else "—")
        rows.append([name, *cells])
    columns = ["", *(label.split(":")[0] for label in sums)] + (["after / before"] if len(sums) == 2 else [])
    console.print(harness.table("L9 under hostile load", columns, rows))
    for label, (m, backend) in results.items():
        console.print(f"{label}, backend {backend}; hostile statuses: " + ("; ".join(
            f"{kind}: " + ", ".join(f"{s} x{n}" for s, n in sorted(c.items()))
            + f" (median {np.median(m.hostile_ms[kind]):,.0f} ms)" for kind, c in m.hostile.items()) or "none sent"))
        if m.stream_errors:
            console.print(f"  stream errors: {dict(m.stream_errors)}")
        s = sums[label]
        met = s["/health p99 (ms)"] <= HEALTH_P99_MS and s["/health max (ms)"] <= HEALTH_MAX_MS
        console.print(f"  target (/health p99 <= {HEALTH_P99_MS:g} ms, max <= {HEALTH_MAX_MS:g} ms): "
                      + ("[green]met[/]" if met else "[red]not met[/]"))
    return sums


def parser() -> OneLineParser:
    p = OneLineParser(prog="l9_responsiveness.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", metavar="REF", help="also measure this git ref's server, first (e.g. main)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per server (default: 20)")
    p.add_argument("--clients", type=int, default=32, help="streaming clients (default: 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed request (default: 64)")
    p.add_argument("--hostile-interval", type=float, default=0.25,
                   help="seconds between hostile requests (default: 0.25; 0: none, a baseline)")
    p.add_argument("--probe-interval", type=float, default=0.01, help="seconds between /health probes")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS and --threads of each server")
    p.add_argument("--model", help="HF-format Qwen3 checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    return p


def check(args) -> None:
    for name in ("duration", "probe_interval"):
        if not getattr(args, name) > 0:
            raise CourseError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not args.hostile_interval >= 0:
        raise CourseError(f"--hostile-interval must be positive, or 0 for none, got {args.hostile_interval}")
    for name in ("clients", "max_tokens", "threads"):
        if getattr(args, name) < 1:
            raise CourseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.before is not None:
        try:
            git("rev-parse", "--verify", "--quiet", args.before + "^{commit}")
        except CourseError:
            raise CourseError(f"--before {args.before!r}: not a commit of this repository") from None


def main() -> None:
    args = parser().parse_args()
    try:
        check(args)
        model_dir = resolve_model_dir(args.model, default_model_dir).resolve()
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    console = Console(width=None if sys.stdout.isatty() else 160)
    conditions = harness.start("cpu", torch.float32, threads=args.threads, code=["scripts/serve.py"])
    cpu = harness.cpu_name()
    console.print(f"[bold]L9 responsiveness[/]: {model_dir.name}, cpu float32, {args.threads} thread(s) per server; "
                  f"{cpu}; {args.duration:g} s per server of {args.clients} streams of {args.max_tokens} tokens, "
                  + (f"a hostile request every {args.hostile_interval:g} s" if args.hostile_interval else
                     "no hostile requests") + f", GET /health every {args.probe_interval * 1e3:g} ms")
    results = {}
    try:
        for ref in ([args.before] if args.before else []) + [None]:
            with tree(ref) as (label, serve):
                results[label] = measure(serve, model_dir, args, console, label)
    except (CourseError, RuntimeError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)
    *before, (_, (_, backend)) = results.items()  # this tree's server last: the backend it really used
    conditions.backend = backend
    conditions.extra["workload"] = (f"{args.duration:g} s per server, {args.clients} streams of {args.max_tokens} tokens, "
                                f"hostile every {args.hostile_interval:g} s, /health every {args.probe_interval:g} s")
    if before:
        conditions.extra["before"] = f"{args.before} (backend {before[0][1][1]})"
    sums = show(console, results)
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"servers": {label: {"backend": b, "summary": sums[label], **vars(m)}
                                                   for label, (m, b) in results.items()}}, conditions, console)


if __name__ == "__main__":
    main()

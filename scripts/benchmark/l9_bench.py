"""L9's server against HuggingFace's own (`transformers serve --continuous-batching`): the same model, the same
load, one invocation.

    OMP_NUM_THREADS=1 python scripts/benchmark/l9_bench.py [--quick] [--concurrency 8,32] [--num-requests 64]
        [--endpoint chat|completions] [--input-len 32-256] [--output-len 16-64] [--seed 0] [--threads 1]
        [--only ours|hf] [--num-blocks N] [--max-batched-tokens N] [--ours-args="..."] [--hf-args="..."]
        [--model DIR] [--json PATH]
    OMP_NUM_THREADS=1 python scripts/benchmark/l9_bench.py --curve [--png PATH]

Each server runs as a child process on a free loopback port, with OMP_NUM_THREADS=--threads, one at a time
(ours first, then HF's; never both: on a 2-core machine they would take each other's cores). The bench waits
until it answers (ours prints `serving NAME at URL`; HF's answers GET /health), warms it up with a few short
requests (HF's server builds its batching engine on its first request, which takes seconds), then sends the
same load at each concurrency with scripts/load.py's client, and stops it with SIGTERM (killed if it has not
exited 30 s later). HF's server gets a temporary HF_HOME whose hub/ exists (its GET /v1/models scans it, and
fails without it) and is addressed by the model directory's path, the only name it answers to.

The load (seeded, the same for both servers and every concurrency): --num-requests chat completions (default)
released at once, prompts of --input-len words, each asking for exactly its --output-len tokens, greedy, with
end-of-sequence ignored so both servers produce every token. HF's server rejects the `ignore_eos` field (422),
so it gets a generation config with eos_token_id -1 instead. The bench checks the counts both servers report
(usage): every request's output tokens must equal its max_tokens, and prompt tokens must agree between the
servers; a mismatch is reported and the exit status is 1. The texts are compared too, for information only:
batching changes floating-point sums, so two correct servers may part ways after a near tie, and the servers
render some tokens differently (HF's streams special tokens' text; ours flushes a character cut off by max_tokens
as U+FFFD).

Our server's pool is sized so every request of the largest concurrency fits at once (--num-blocks overrides
it); HF's server keeps its own defaults (--hf-args passes its --cb-* options).

Reported per concurrency, ours and HF's side by side with the ratio ours / HF: request and output-token
throughput, TTFT p50/p99, TPOT p50/p99, ITL p50/p99 and E2EL p50; with the thread count and load average.
Target (a benchmark, not a test): at every concurrency, at least 2x HF's output-token throughput with a lower
p99 TTFT.

--curve measures throughput against concurrency instead: 1, 2, 4, ... 64 clients, max(16, 2 x concurrency)
requests at each (--num-requests overrides), outputs of 16-32 tokens unless --output-len says otherwise,
both servers through every level (ours first, then HF's, as above). It prints each server's output tok/s
and p99 TTFT per level, and where each saturates: the fewest clients that reach 90% of its best
throughput. --png PATH draws both curves. About 4 minutes on this course's 2-core machine; few requests a
level, so the ramp-up and the drain weigh on each point (the same on both servers). The default run (64 requests at concurrency 8 and 32) takes about 80 s on one thread of this
course's 2-core machine, --quick (16 requests at 4 and 8) about 45 s; half of either is starting and warming
up the servers (HF's builds its batching engine on its first request: about 10 s).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark's own modules
sys.path.insert(0, str(ROOT / "scripts"))  # load.py
sys.path.insert(0, str(ROOT))
import bench_conditions  # noqa: E402
from load import LoadError, LoadResult, LoadSpec, parse_range, result_json, run_load, summarize  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

FULL = {"num_requests": 64, "concurrency": "8,32"}
QUICK = {"num_requests": 16, "concurrency": "4,8"}
CURVE = {"concurrency": "1,2,4,8,16,32,64", "output_len": "16-32"}
CURVE_MIN_REQUESTS = 16  # a level's requests: max(this, 2 x its concurrency), so each client sends twice
SATURATED = 0.9  # a server saturates at the fewest clients that reach this share of its best throughput
OUTPUT_LEN = "16-64"
BLOCK_SIZE = 16
CHAT_OVERHEAD = 16  # tokens a chat template adds around one user message, with room to spare
WARMUP = LoadSpec(num_requests=4, concurrency=4, input_len=(16, 48), output_len=(8, 8), seed=12345)
BANNER = re.compile(r"^serving (\S+) at (http://\S+/v1)\s*$", re.M)
THROUGHPUT_TARGET = 2.0
STOP_GRACE_S = 30.0


class BenchError(Exception):
    """A server that would not start, died, or answered wrongly: one line, exit status 1."""


# ----- the servers -----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server as a child process: its output goes to a temporary log, read back for the banner and to explain
    a failure."""

    def __init__(self, label: str, cmd: list[str], env: dict, model: str, url: str | None = None):
        self.label, self.cmd, self.env, self.model, self.url = label, cmd, env, model, url
        self.log = tempfile.NamedTemporaryFile(mode="w+", prefix=f"l9_bench_{label}_", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def log_tail(self, lines: int = 12) -> str:
        text = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return "\n    ".join(text[-lines:]) or "(empty log)"

    def start(self, deadline_s: float) -> None:
        """Start and wait until it answers: the banner (ours), or GET /health answering 200 (HF's)."""
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)  # a Ctrl-C in the terminal reaches us, not it
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.label} exited with status {self.proc.returncode} before answering; its "
                                 f"log ({self.log.name}):\n    {self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.25)
        self.stop()
        raise BenchError(f"{self.label} did not answer within {deadline_s:.0f} s; its log ({self.log.name}):\n"
                         f"    {self.log_tail()}")

    def ready(self) -> bool:
        if self.url is None:  # ours: the banner says where, once it answers
            match = BANNER.search(Path(self.log.name).read_text(errors="replace"))
            if match:
                self.model, self.url = match.groups()
            return match is not None
        try:
            return httpx.get(self.url.removesuffix("/v1") + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after STOP_GRACE_S; the exit status (negative: the signal that ended it)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise BenchError(f"{self.label} died (exit status {self.proc.returncode}); its log ({self.log.name}):\n"
                             f"    {self.log_tail()}")


def server_env(threads: int, **extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **extra}


def ours(args, model_dir: Path) -> Server:
    cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", "0", "--threads", str(args.threads), "--device", "cpu", "--block-size", str(BLOCK_SIZE),
           "--num-blocks", str(args.num_blocks)]
    if args.max_batched_tokens is not None:
        cmd += ["--max-batched-tokens", str(args.max_batched_tokens)]
    return Server("ours", cmd + shlex.split(args.ours_args), server_env(args.threads), model="")


def hf(args, model_dir: Path, hf_home: Path) -> Server:
    port = free_port()  # its own --port 0 would not tell us which port it took
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", "--continuous-batching", "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.hf_args), str(model_dir)]
    return Server("HF", cmd, server_env(args.threads, HF_HOME=str(hf_home)), model=str(model_dir),
                  url=f"http://127.0.0.1:{port}/v1")


def scrape(url: str, name: str) -> float | None:
    """One value from our server's Prometheus /metrics (None when absent: its names are not this bench's)."""
    try:
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M)
    return float(match.group(1)) if match else None


# ----- one server's runs -----

def timed_load(spec: LoadSpec, server: Server, console: Console, what: str) -> LoadResult:
    with Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True,
                  disable=not console.is_terminal) as progress:  # a log file gets the lines, not the bar
        task = progress.add_task(what, total=spec.num_requests)
        return asyncio.run(run_load(spec, server.url, server.model, on_done=lambda r: progress.advance(task)))


def measure(server: Server, specs: list[LoadSpec], args, console: Console) -> dict:
    """Start, warm up, run every spec, stop. {"runs": [(spec, result)], "exit_status", "notes"}."""
    notes: list[str] = []
    t0 = time.perf_counter()
    server.start(args.startup_timeout)
    try:
        console.print(f"[bold]{server.label}[/]: answering after {time.perf_counter() - t0:.1f} s at {server.url} "
                      f"(model {server.model})")
        warm = replace(WARMUP, endpoint=specs[0].endpoint, ignore_eos=True,
                       ignore_eos_field=specs[0].ignore_eos_field, timeout=specs[0].timeout)
        t1 = time.perf_counter()
        w = timed_load(warm, server, console, f"{server.label} warm-up")
        failed = [r.error for r in w.records if not r.ok]
        if failed:
            server.check_alive()
            raise BenchError(f"{server.label} failed its warm-up requests: {failed[0]}")
        console.print(f"  warm-up: {warm.num_requests} requests in {time.perf_counter() - t1:.1f} s")
        runs = []
        for spec in specs:
            preempted = scrape(server.url, "paged_preemptions_total") if server.label == "ours" else None
            result = timed_load(spec, server, console, f"{server.label}, concurrency {spec.concurrency}")
            server.check_alive()
            done = sum(r.ok for r in result.records)
            console.print(f"  concurrency {spec.concurrency}: {done}/{spec.num_requests} requests in "
                          f"{result.duration_s:.1f} s")
            if preempted is not None:
                after = scrape(server.url, "paged_preemptions_total")
                if after is not None and after > preempted:
                    notes.append(f"concurrency {spec.concurrency}: {after - preempted:.0f} preemption(s)")
            runs.append((spec, result))
    finally:
        status = server.stop()
    Path(server.log.name).unlink()  # kept only when something failed, to be read
    expected = 0 if server.label == "ours" else None  # our contract: SIGTERM ends it with 0
    if expected is not None and status != expected:
        notes.append(f"exit status {status} after SIGTERM (expected {expected})")
    return {"runs": runs, "exit_status": status, "notes": notes}


# ----- the comparison -----

COLUMNS = [  # (label, summary path, unit, higher is better)
    ("req/s", ("request_throughput",), "", True),
    ("output tok/s", ("output_throughput",), "", True),
    ("TTFT p50", ("ttft_ms", "p50"), "ms", False), ("TTFT p99", ("ttft_ms", "p99"), "ms", False),
    ("TPOT p50", ("tpot_ms", "p50"), "ms", False), ("TPOT p99", ("tpot_ms", "p99"), "ms", False),
    ("ITL p50", ("itl_ms", "p50"), "ms", False), ("ITL p99", ("itl_ms", "p99"), "ms", False),
    ("E2EL p50", ("e2el_ms", "p50"), "ms", False),
]


def pick(summary: dict, path: tuple[str, ...]) -> float | None:
    value = summary
    for key in path:
        value = value[key]
    return value


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def token_check(spec: LoadSpec, by_server: dict[str, LoadResult]) -> dict:
    """Both servers must have produced exactly max_tokens per request, counted by themselves (usage), on the
    same prompt token counts; identical greedy texts are counted for information."""
    problems, same_text, first_diff = [], 0, None
    for label, result in by_server.items():
        for r in result.records:
            if r.ok and (r.token_source != "usage" or r.output_tokens != r.max_tokens):
                problems.append(f"{label}: request {r.index} produced {r.output_tokens} tokens "
                                f"({r.token_source}), asked for {r.max_tokens}")
    if len(by_server) == 2:
        a, b = by_server.values()
        for x, y in zip(a.records, b.records):
            if x.ok and y.ok and x.prompt_tokens != y.prompt_tokens:
                problems.append(f"request {x.index}: prompt tokens {x.prompt_tokens} (ours) vs {y.prompt_tokens} (HF)")
            same_text += x.ok and y.ok and x.text == y.text
            if x.ok and y.ok and x.text != y.text and first_diff is None:
                at = len(os.path.commonprefix([x.text, y.text]))
                first_diff = f"request {x.index} at character {at}: {x.text[at:at + 24]!r} vs {y.text[at:at + 24]!r}"
    return {"problems": problems, "same_text": same_text if len(by_server) == 2 else None,
            "first_text_difference": first_diff, "requests": spec.num_requests}


def show(console: Console, rows: list[dict], labels: list[str]) -> None:
    names = {"ours": "L9's server", "HF": "HF's transformers serve --continuous-batching"}
    t = Table(title=" vs ".join(names[label] for label in labels))
    t.add_column("concurrency", justify="right")
    t.add_column("server")
    for name, _, unit, _ in COLUMNS:
        t.add_column(f"{name}" + (f" ({unit})" if unit else ""), justify="right")
    for row in rows:
        for label in labels:
            cells = [str(row["concurrency"]), label]
            for name, _, _, _ in COLUMNS:
                value = row["servers"][label][name]
                cells.append("—" if value is None else f"{value:,.1f}" if value >= 10 else f"{value:,.2f}")
            t.add_row(*cells)
        if len(labels) == 2:
            cells = ["", "[bold]ours / HF[/]"]
            for name, _, _, higher in COLUMNS:
                x = row["ratio"][name]
                good = x is not None and (x > 1 if higher else x < 1)
                cells.append("—" if x is None else f"[{'green' if good else 'red'}]{x:.2f}x[/]")
            t.add_row(*cells, end_section=True)
    console.print(t)
    if len(labels) == 2:
        console.print("  ratio ours / HF: throughput higher is better, latencies lower is better (green: ours ahead)")


def target(rows: list[dict]) -> dict:
    per = {row["concurrency"]: {"throughput_x": row["ratio"]["output tok/s"], "ttft_p99_x": row["ratio"]["TTFT p99"]}
           for row in rows}
    met = {c: v["throughput_x"] is not None and v["throughput_x"] >= THROUGHPUT_TARGET and v["ttft_p99_x"] is not None
           and v["ttft_p99_x"] < 1 for c, v in per.items()}
    return {"met": all(met.values()), "per_concurrency": per, "met_at": [c for c, ok in met.items() if ok]}


# ----- the command line -----

def parser() -> OneLineParser:
    p = OneLineParser(prog="l9_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['num_requests']} requests at concurrency {QUICK['concurrency']}")
    p.add_argument("--curve", action="store_true",
                   help=f"throughput against concurrency {CURVE['concurrency']}, max({CURVE_MIN_REQUESTS}, 2 x "
                        f"concurrency) requests each, outputs of {CURVE['output_len']} tokens")
    p.add_argument("--png", metavar="PATH", help="--curve: draw both servers' curves into this PNG")
    p.add_argument("--concurrency", help=f"comma-separated (default: {FULL['concurrency']})")
    p.add_argument("--num-requests", type=int, help=f"requests per concurrency (default: {FULL['num_requests']})")
    p.add_argument("--endpoint", default="chat", choices=("chat", "completions"))
    p.add_argument("--input-len", default="32-256", help="prompt words, MIN-MAX (default: 32-256)")
    p.add_argument("--output-len", help=f"output tokens, MIN-MAX (default: {OUTPUT_LEN}; --curve: "
                   f"{CURVE['output_len']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server (default: 1)")
    p.add_argument("--only", choices=("ours", "hf"), help="run one server only (no ratios, no target)")
    p.add_argument("--model", help="HF-format Qwen3 checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--num-blocks", type=int, help="our server's pool (default: every request of the largest "
                   "concurrency fits at once)")
    p.add_argument("--max-batched-tokens", type=int, help="our server's token budget per step (default: its own)")
    p.add_argument("--ours-args", default="", help='more options for scripts/serve.py, as --ours-args="--x 1"')
    p.add_argument("--hf-args", default="", help='more options for transformers serve, as --hf-args="--cb-num-blocks 64"')
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a server gets to answer")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", metavar="PATH", help="also write the report, every request included, as JSON")
    return p


def settings(args) -> list[LoadSpec]:
    """Fill what --quick decides and check every option: a bad one fails here, before any server starts."""
    if args.quick and args.curve:
        raise CourseError("--quick and --curve are two different runs: pick one")
    if args.png and not args.curve:
        raise CourseError("--png draws the --curve run: add --curve")
    base = CURVE if args.curve else QUICK if args.quick else FULL
    args.concurrency = args.concurrency or base["concurrency"]
    args.output_len = args.output_len or base.get("output_len", OUTPUT_LEN)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise CourseError(f"--concurrency {args.concurrency!r}: use comma-separated integers") from None
    if any(c < 1 for c in levels):
        raise CourseError(f"--concurrency: every level must be at least 1, got {levels}")
    if args.num_requests is not None and args.num_requests < 1:
        raise CourseError(f"--num-requests must be at least 1, got {args.num_requests}")
    per_level = {c: args.num_requests or (max(CURVE_MIN_REQUESTS, 2 * c) if args.curve else base["num_requests"])
                 for c in levels}
    args.num_requests = args.num_requests or base.get("num_requests")
    if args.png:
        try:
            import matplotlib  # noqa: F401  (fail before the run, not after it)
        except ImportError:
            raise CourseError("--png needs matplotlib: pip install matplotlib") from None
    for name in ("threads", "num_blocks", "max_batched_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CourseError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if not args.startup_timeout > 0:
        raise CourseError(f"--startup-timeout must be positive, got {args.startup_timeout}")
    try:
        base_spec = LoadSpec(num_requests=per_level[levels[0]], input_len=parse_range(args.input_len, "input-len"),
                             output_len=parse_range(args.output_len, "output-len"), seed=args.seed,
                             endpoint=args.endpoint, ignore_eos=True, timeout=args.timeout)
        specs = [replace(base_spec, concurrency=c, num_requests=per_level[c]) for c in levels]
        for spec in specs:
            spec.check()
        for flag, text in (("--ours-args", args.ours_args), ("--hf-args", args.hf_args)):
            try:
                shlex.split(text)
            except ValueError as e:
                raise CourseError(f"{flag} {text!r}: {e}") from None
    except LoadError as e:
        raise CourseError(str(e)) from None
    if args.num_blocks is None:  # every request of the largest level at once: the run measures scheduling alone
        per_request = math.ceil((base_spec.input_len[1] + CHAT_OVERHEAD + base_spec.output_len[1]) / BLOCK_SIZE)
        args.num_blocks = max(levels) * per_request + 1
    if args.only != "ours":
        try:
            import fastapi, uvicorn  # noqa: F401, E401  (HF's server needs both: fail before the first server)
        except ImportError:
            raise CourseError('HF\'s server needs fastapi and uvicorn: pip install "transformers[serving]"') from None
    return specs


def run(args, specs: list[LoadSpec], model_dir: Path, console: Console) -> dict:
    """Ours, then HF's, each through every spec. {label: measure(...)}"""
    out = {}
    with tempfile.TemporaryDirectory(prefix="l9_bench_hf_home_") as hf_home:
        (Path(hf_home) / "hub").mkdir()
        servers = []
        if args.only != "hf":
            servers.append(ours(args, model_dir))
        if args.only != "ours":
            servers.append(hf(args, model_dir, Path(hf_home)))
        for server in servers:
            server_specs = specs
            if server.label == "HF":  # transformers serve rejects ignore_eos: the same request, its own spelling
                server_specs = [replace(s, ignore_eos_field="generation_config") for s in specs]
            out[server.label] = measure(server, server_specs, args, console)
    return out


def compare(measured: dict, specs: list[LoadSpec]) -> list[dict]:
    rows = []
    for k, spec in enumerate(specs):
        by_server = {label: m["runs"][k][1] for label, m in measured.items()}
        summaries = {label: summarize(r.records, r.duration_s) for label, r in by_server.items()}
        values = {label: {name: pick(s, path) for name, path, _, _ in COLUMNS} for label, s in summaries.items()}
        row = {"concurrency": spec.concurrency, "servers": values, "summaries": summaries,
               "tokens": token_check(spec, by_server)}
        if len(values) == 2:
            row["ratio"] = {name: ratio(values["ours"][name], values["HF"][name]) for name, _, _, _ in COLUMNS}
        rows.append(row)
    return rows


def report_checks(console: Console, rows: list[dict], measured: dict) -> bool:
    """Failures, token-count mismatches and notes; True when everything was as asked."""
    clean = True
    for row in rows:
        c = row["concurrency"]
        for label, s in row["summaries"].items():
            if s["failed"]:
                clean = False
                console.print(f"[red]{label}, concurrency {c}: {s['failed']} request(s) failed[/]; the first: "
                              f"{s['first_error']}")
        tokens = row["tokens"]
        if tokens["problems"]:
            clean = False
            console.print(f"[red]concurrency {c}: {len(tokens['problems'])} token-count mismatch(es)[/]; the first: "
                          f"{tokens['problems'][0]}")
        else:
            console.print(f"  concurrency {c}: every request produced exactly its max_tokens (usage), on "
                          + ("the same prompt token counts in both servers" if tokens["same_text"] is not None
                             else "one server"))
        if tokens["same_text"] is not None:
            diff = tokens["first_text_difference"]
            console.print(f"  concurrency {c}: greedy texts identical in {tokens['same_text']} of "
                          f"{tokens['requests']} requests (information)" + (f"; the first difference, ours vs HF: "
                                                                            f"{diff}" if diff else ""))
    for label, m in measured.items():
        for note in m["notes"]:
            console.print(f"  [yellow]{label}: {note}[/]")
    return clean


def main() -> None:
    args = parser().parse_args()
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        specs = settings(args)
        model_dir = resolve_model_dir(args.model, default_model_dir).resolve()
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(args.threads)  # so bench_conditions reports the servers' thread count
    conditions = bench_conditions.start()
    spec = specs[0]
    console.print(f"[bold]L9 server benchmark[/]: {model_dir.name}, cpu, {args.threads} thread(s) per server, "
                  f"seed {args.seed}")
    requests = (f"{spec.num_requests}" if len({s.num_requests for s in specs}) == 1
                else "/".join(str(s.num_requests) for s in specs))
    console.print(f"  load: {requests} {spec.endpoint} requests at concurrency "
                  f"{', '.join(str(s.concurrency) for s in specs)}, all released at once; prompts of "
                  f"{spec.input_len[0]}-{spec.input_len[1]} words, {spec.output_len[0]}-{spec.output_len[1]} output "
                  f"tokens each (end-of-sequence ignored), greedy")
    pools = [f"our pool: {args.num_blocks} blocks of {BLOCK_SIZE}"] if args.only != "hf" else []
    pools += [f"HF's server: its own defaults" + (f" plus {args.hf_args}" if args.hf_args else "")] \
        if args.only != "ours" else []
    console.print("  " + "; ".join(pools))
    t0 = time.perf_counter()
    try:
        measured = run(args, specs, model_dir, console)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)
    wall = time.perf_counter() - t0
    bench_conditions.finish(conditions, console)
    rows = compare(measured, specs)
    show(console, rows, list(measured))
    clean = report_checks(console, rows, measured)
    goal, curve = None, None
    if args.curve:
        curve = curve_summary(rows, list(measured))
        show_curve(console, curve, list(measured))
        if args.png:
            console.print(f"plot written to {plot_curve(curve, list(measured), Path(args.png), conditions)}")
    elif len(measured) == 2:
        goal = target(rows)
        per = "; ".join(f"concurrency {c}: throughput {v['throughput_x']:.2f}x, TTFT p99 {v['ttft_p99_x']:.2f}x"
                        for c, v in goal["per_concurrency"].items()
                        if v["throughput_x"] is not None and v["ttft_p99_x"] is not None)
        verdict = "[green]met[/]" if goal["met"] else "[red]not met[/]"
        console.print(f"target {verdict} (≥ {THROUGHPUT_TARGET:g}x HF's output-token throughput with a lower p99 TTFT "
                      f"at every concurrency): {per}")
    report = {"command": " ".join(sys.argv), "machine": f"{bench_conditions.cpu_name()}, "
              f"{os.cpu_count()} CPU cores, torch {torch.__version__}", "model": str(model_dir),
              "conditions": conditions, "threads": args.threads, "wall_seconds": wall, "our_num_blocks": args.num_blocks,
              "hf_args": args.hf_args, "ours_args": args.ours_args,
              "servers": {label: {"exit_status": m["exit_status"], "notes": m["notes"],
                                  "runs": [load_json(r) for _, r in m["runs"]]} for label, m in measured.items()},
              "comparison": [{k: v for k, v in row.items() if k != "summaries"} for row in rows], "target": goal,
              "curve": curve}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        console.print(f"results written to {args.json}")
    console.print(f"wall time {wall:.0f} s")
    raise SystemExit(0 if clean else 1)


# ----- the curve -----

def curve_summary(rows: list[dict], labels: list[str]) -> dict:
    """Per server: output tok/s and p99 TTFT at each concurrency, its best throughput, and where it saturates
    (the fewest clients reaching SATURATED of that best)."""
    out = {}
    for label in labels:
        points = [{"concurrency": row["concurrency"], "output_tok_s": row["servers"][label]["output tok/s"],
                   "ttft_p99_ms": row["servers"][label]["TTFT p99"]} for row in rows]
        best = max((p["output_tok_s"] or 0.0) for p in points)
        saturates = next((p["concurrency"] for p in points if (p["output_tok_s"] or 0.0) >= SATURATED * best), None)
        out[label] = {"points": points, "best_output_tok_s": best, "saturates_at": saturates}
    return out


def show_curve(console: Console, curve: dict, labels: list[str]) -> None:
    t = Table(title="throughput against concurrency")
    t.add_column("concurrency", justify="right")
    for label in labels:
        t.add_column(f"{label} tok/s", justify="right")
        t.add_column(f"{label} TTFT p99 (ms)", justify="right")
    if len(labels) == 2:
        t.add_column("tok/s ours / HF", justify="right")
    for k, point in enumerate(curve[labels[0]]["points"]):
        cells = [str(point["concurrency"])]
        values = [curve[label]["points"][k] for label in labels]
        for v in values:
            cells += [f"{v['output_tok_s']:,.1f}" if v["output_tok_s"] is not None else "—",
                      f"{v['ttft_p99_ms']:,.0f}" if v["ttft_p99_ms"] is not None else "—"]
        if len(labels) == 2:
            x = ratio(values[0]["output_tok_s"], values[1]["output_tok_s"])
            cells.append("—" if x is None else f"{x:.2f}x")
        t.add_row(*cells)
    console.print(t)
    for label in labels:
        c = curve[label]
        console.print(f"  {label}: best {c['best_output_tok_s']:,.1f} output tok/s; saturates at {c['saturates_at']} "
                      f"client(s) (the fewest reaching {SATURATED:.0%} of its best)")


def plot_curve(curve: dict, labels: list[str], path: Path, conditions: dict) -> Path:
    """Output tok/s (left) and p99 TTFT (right) against concurrency, one line per server, log2 x-axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"ours": "L9's server", "HF": "HF's transformers serve --continuous-batching"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, color in zip(labels, ("tab:blue", "tab:orange")):
        points = [p for p in curve[label]["points"] if p["output_tok_s"] is not None]
        xs = [p["concurrency"] for p in points]
        left.plot(xs, [p["output_tok_s"] for p in points], "-o", color=color, label=names[label])
        right.plot(xs, [p["ttft_p99_ms"] for p in points], "-o", color=color, label=names[label])
        if curve[label]["saturates_at"] is not None:
            left.axvline(curve[label]["saturates_at"], color=color, ls=":", lw=1)
    levels = [p["concurrency"] for p in curve[labels[0]]["points"]]
    for ax, what in ((left, "output tokens/s"), (right, "TTFT p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    left.set_title("throughput (dotted: where each saturates)", fontsize=9)
    right.set_title("time to first token, p99", fontsize=9)
    fig.suptitle(f"{conditions['threads']} torch thread(s) per server, {bench_conditions.cpu_name()}, load average "
                 f"{conditions['load_before']['load1']:.2f} before the run", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_json(result: LoadResult) -> dict:
    return result_json(result, summarize(result.records, result.duration_s))


if __name__ == "__main__":
    main()

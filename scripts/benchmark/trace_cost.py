"""What recording the pool costs: the server's engine (L14's, default mode) on one workload, recorded and not,
in one run, taking turns, one torch thread.

    OMP_NUM_THREADS=1 python scripts/benchmark/trace_cost.py [--requests 32] [--rounds 5] [--json PATH]

Modes: off (never recorded), detached (a recorder attached, then closed before the run: the engine's own code
again, which is what "no cost when off" means), file (a trace written to a file, as the smokes' --trace),
live (serve.py --pool-viewer's in-memory trace, no poller). The workload: bench.py's mixed requests (prompts of
32-256 tokens, 16-64 new tokens, a shared 64-token system prompt on half of them so the prefix cache works),
all submitted at once to a 4,096-token pool; the whole run is timed, and the step count is the same in every
mode (recording changes no decision). The table gives each mode's median and mode / off.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark's own modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_systems as bs  # noqa: E402
import harness  # noqa: E402
from lessons.l14_batch_invariant import L14Engine  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.pool_live import LivePool  # noqa: E402
from shared.pool_trace import PoolRecorder  # noqa: E402
from shared.smoke import exit_with  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

MODES = ("off", "detached", "file", "live")
KV_TOKENS, BLOCK = 4096, 16


def parser() -> OneLineParser:
    p = OneLineParser(prog="trace_cost.py", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    return p


def workload(n: int, vocab: int, seed: int) -> list[bs.Job]:
    half = n // 2
    return (bs.make_workload(n - half, (32, 256), (16, 64), vocab, seed)
            + bs.make_shared_prefix_workload(half, 64, (16, 192), (16, 64), vocab, seed))


def one_run(model, mode: str, jobs: list[bs.Job], trace_path: Path) -> tuple[float, int, int]:
    """Seconds for the whole run, its steps, and the trace's lines (0 when nothing was recorded)."""
    engine = L14Engine(model, BLOCK, KV_TOKENS // BLOCK, max_running=64)
    out, recorder = None, None
    if mode == "detached":
        PoolRecorder(engine, open(trace_path, "w"), "l14").close()
    elif mode == "file":
        out = open(trace_path, "w")
        recorder = PoolRecorder(engine, out, "l14")
    elif mode == "live":
        out = LivePool()
        recorder = PoolRecorder(engine, out, "l14")
    t0 = time.perf_counter()
    for j in jobs:
        engine.add_request(j.prompt_ids, bs.stop_for(j))
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
    if recorder is not None:
        recorder.close()
    seconds = time.perf_counter() - t0
    lines = 0
    if mode == "file":
        out.close()
        lines = sum(1 for _ in open(trace_path))
    elif mode == "live":
        lines = out.first + len(out.records) + 1
    return seconds, steps, lines


def run(args, console: Console) -> int:
    if args.rounds < 1 or args.requests < 1:
        raise CourseError(f"--rounds and --requests must be at least 1, got {args.rounds} and {args.requests}")
    model = Qwen3ForCausalLM.from_dir(default_model_dir(), torch.float32, torch.device("cpu"))
    jobs = workload(args.requests, model.config.vocab_size, args.seed)
    conditions = harness.start("cpu", torch.float32, backend="cpp", code=["scripts/benchmark/bench_systems.py"])
    conditions.extra.update(model="tiny", requests=str(args.requests), rounds=str(args.rounds))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    steps: set[int] = set()
    lines = 0
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for _, mode in harness.alternate(MODES, args.rounds):
            seconds, n, written = one_run(model, mode, jobs, Path(tmp) / "trace.jsonl")
            times[mode].append(seconds)
            steps.add(n)
            lines = max(lines, written)
            console.print(f"  {mode}: {seconds:.3f} s, {n} steps", highlight=False)
    if len(steps) != 1:
        raise CourseError(f"the modes ran different numbers of steps ({sorted(steps)}): recording changed the run")
    median = {m: statistics.median(t) for m, t in times.items()}
    (n,) = steps
    rows = [[m, f"{median[m]:.3f}", f"{1e3 * median[m] / n:.2f}", f"{median[m] / median['off']:.3f}x"] for m in MODES]
    console.print(harness.table(f"recording the pool: {args.requests} requests, {n} steps, median of {args.rounds} "
                                f"rounds ({lines} trace lines)", ["mode", "run (s)", "per step (ms)", "mode / off"],
                                rows))
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"median": median, "rounds": times, "steps": n}, conditions, console)
    return 0


if __name__ == "__main__":
    exit_with(lambda: run(parser().parse_args(), Console()))

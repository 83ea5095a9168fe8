"""Per-step decode time, eager (L6's path) vs L7's static-buffer runner, at several batch sizes.

    OMP_NUM_THREADS=1 python scripts/benchmark/l7_bench.py [--batch-sizes 1,3,8,13] [--steps 40] [--device cpu] [--model DIR]

Both engines run the same B requests in one process: prefill, 3 warm-up decode steps, then `--steps` timed
decode steps (schedule + forward + sample), the two engines' steps in alternating order (harness.alternate);
median per step. On CPU there is no capture, so this measures what the static buffers cost (the copy-in, the
padded rows); on CUDA it measures what replay saves. The conditions line (commit, CPU, threads, the attention
backend the engines really used, load) is printed last.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's lessons/ and shared/, not an installed course's
import harness  # noqa: E402  (scripts/benchmark/, this script's folder)
from lessons.l7_cuda_graphs import L7Engine  # noqa: E402
from lessons.l7_cuda_graphs.capture_sizes import default_capture_sizes, padded_size  # noqa: E402
from shared.cli import OneLineParser, resolve_device, resolve_dtype, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

WARMUP, PROMPT_LEN, MAX_RUNNING = 3, 16, 64


def engine_with(model: Qwen3ForCausalLM, batch: int, steps: int, graphs: bool, backend: str) -> L7Engine:
    """B requests admitted and prefilled (eager either way): every later step is a decode step of B rows."""
    engine = L7Engine(model, 16, None, MAX_RUNNING, backend, graphs=graphs)
    stop = StopRule(WARMUP + steps + 2, frozenset(), ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 + 1 for j in range(PROMPT_LEN)], stop)
    engine.step()
    return engine


def timed_step(engine: L7Engine) -> float:
    cuda = engine.model.lm_head.weight.is_cuda
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def step_times(model: Qwen3ForCausalLM, batch: int, steps: int, backend: str) -> tuple[dict[str, list[float]], str]:
    """Seconds per decode step of each engine ('eager', 'L7'), their steps alternating so both see the same load;
    and the attention backend they really used."""
    engines = {"eager": engine_with(model, batch, steps, False, backend),
               "L7": engine_with(model, batch, steps, True, backend)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for k, name in harness.alternate(list(engines), WARMUP + steps):
        seconds = timed_step(engines[name])
        if k >= WARMUP:
            times[name].append(seconds)
    runner = engines["L7"].runner
    assert runner.eager_steps == 1 or batch > max(runner.sizes), "every decode step was static"
    return times, harness.backend_name(engines["L7"])


def parser() -> OneLineParser:
    p = OneLineParser(prog="l7_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,3,8,13", help="comma-separated decode batch sizes")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per engine")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--backend", default="auto", help="attention backend of both engines (auto | cpp | batched | "
                   "torch | flashinfer)")
    p.add_argument("--model", help="HF-format Qwen3 checkpoint directory (default: the embedded tiny model)")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes {args.batch_sizes!r}: use comma-separated integers")
    if args.steps < 1 or any(not 1 <= b <= MAX_RUNNING for b in batches):
        p.error(f"--steps must be >= 1 and every batch size 1..{MAX_RUNNING}")
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(None, device)
        model_dir = resolve_model_dir(args.model, default_model_dir)
        model = Qwen3ForCausalLM.from_dir(model_dir, dtype, device)
    except CourseError as e:
        p.error(str(e))
    console = Console(width=120)
    conditions = harness.start(device, dtype)
    conditions.extra["model"] = "embedded" if args.model is None else args.model
    sizes = default_capture_sizes(MAX_RUNNING)
    rows = []
    for b in batches:
        times, conditions.backend = step_times(model, b, args.steps, args.backend)
        eager, static = (harness.percentiles(times[name], (50,))["p50"] * 1e3 for name in ("eager", "L7"))
        rows.append([str(b), str(padded_size(sizes, b)), f"{eager:.2f}", f"{static:.2f}", f"{static / eager:.2f}"])
    console.print(harness.table(f"decode step, median of {args.steps} timed steps per engine, the engines' steps "
                                "alternating", ["batch", "padded to", "eager ms", "L7 ms", "L7 / eager"], rows))
    harness.finish(conditions, console)


if __name__ == "__main__":
    main()

"""Per-step decode time, eager (L6's path) vs L7's static-buffer runner, at several batch sizes.

    OMP_NUM_THREADS=1 python scripts/benchmark/l7_bench.py [--batch-sizes 1,3,8,13] [--steps 40] [--device cpu] [--model DIR]

Both engines run the same B requests in one process: prefill, 3 warm-up decode steps, then `--steps` timed
decode steps (schedule + forward + sample), the two engines' steps interleaved; median per step. On CPU there is no capture, so this measures
what the static buffers cost (the copy-in, the padded rows); on CUDA it measures what replay saves.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lessons.l7_cuda_graphs import L7Engine
from lessons.l7_cuda_graphs.capture_sizes import default_capture_sizes, padded_size
from shared.cli import OneLineParser, resolve_device, resolve_dtype, resolve_model_dir
from shared.errors import CourseError
from shared.generation import StopRule
from shared.model import Qwen3ForCausalLM
from shared.tiny_qwen3 import default_model_dir

WARMUP, PROMPT_LEN, MAX_RUNNING = 3, 16, 64


def engine_with(model: Qwen3ForCausalLM, batch: int, steps: int, graphs: bool) -> L7Engine:
    """B requests admitted and prefilled (eager either way): every later step is a decode step of B rows."""
    engine = L7Engine(model, 16, None, MAX_RUNNING, "auto", graphs=graphs)
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


def step_times(model: Qwen3ForCausalLM, batch: int, steps: int) -> tuple[list[float], list[float]]:
    """(eager, L7) seconds per decode step, the two engines' steps interleaved so both see the same load."""
    eager, static = engine_with(model, batch, steps, False), engine_with(model, batch, steps, True)
    out: tuple[list[float], list[float]] = ([], [])
    for k in range(WARMUP + steps):
        pair = (timed_step(eager), timed_step(static))
        if k >= WARMUP:
            out[0].append(pair[0]), out[1].append(pair[1])
    assert static.runner.eager_steps == 1 or batch > max(static.runner.sizes), "every decode step was static"
    return out


def main() -> None:
    p = OneLineParser(prog="l7_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,3,8,13", help="comma-separated decode batch sizes")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per engine")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--model", help="HF-format Qwen3 checkpoint directory (default: the embedded tiny model)")
    args = p.parse_args()
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes {args.batch_sizes!r}: use comma-separated integers")
    if args.steps < 1 or any(not 1 <= b <= MAX_RUNNING for b in batches):
        p.error(f"--steps must be >= 1 and every batch size 1..{MAX_RUNNING}")
    try:
        device = resolve_device(args.device)
        model_dir = resolve_model_dir(args.model, default_model_dir)
        model = Qwen3ForCausalLM.from_dir(model_dir, resolve_dtype(None, device), device)
    except CourseError as e:
        p.error(str(e))
    sizes = default_capture_sizes(MAX_RUNNING)
    print(f"device {device}, torch threads {torch.get_num_threads()}, {args.steps} timed steps, median ms per step")
    print(f"{'batch':>5} {'padded to':>9} {'eager ms':>9} {'L7 ms':>9} {'L7 / eager':>10}")
    for b in batches:
        eager, static = (statistics.median(t) * 1e3 for t in step_times(model, b, args.steps))
        print(f"{b:>5} {padded_size(sizes, b):>9} {eager:>9.2f} {static:>9.2f} {static / eager:>10.2f}")


if __name__ == "__main__":
    main()

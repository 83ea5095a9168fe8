"""What L14's batch-invariant mode costs: the same engine (L14Engine) in its default mode and with
`batch_invariant=True`, in one run, taking turns, one torch thread.

    OMP_NUM_THREADS=1 python scripts/benchmark/l14_bench.py [--model tiny|bench|smollm2] [--dtype float32|bfloat16]
        [--rounds 5] [--batch-invariant both|on|off] [--requests 64] [--json PATH]

a. Decode at batch 1 and 16: that many 128-token prompts prefilled, then 32 decode steps timed (ms per step).
b. A 512-token prefill: one prompt, its one step timed (max-batched-tokens 512).
c. An L4-style run: bench.py's mixed workload (--requests requests, prompts of 32-512 tokens, 16-128 new tokens,
   a 8,192-token pool, all submitted at once), the whole run timed.
Each measurement runs its modes in harness.alternate's order on fresh engines, --rounds times; the table gives
each mode's median and invariant / default (above 1: the mode is slower). Target: decode at batch 1 and at batch
16 within 1.05x (both modes take the same few-row matmul there).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark's own modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_systems as bs  # noqa: E402
import harness  # noqa: E402
from lessons.l14_batch_invariant import L14Engine  # noqa: E402
from shared.cli import OneLineParser, resolve_dtype, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.smoke import exit_with  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

MODELS: dict[str, Callable[[], Path]] = {"tiny": default_model_dir, "bench": bs.bench_shape_dir,
                                         "smollm2": lambda: resolve_model_dir("smollm2", default_model_dir)}
MODES = {"default": False, "invariant": True}
PROMPT, DECODE_STEPS, PREFILL, KV_TOKENS = 128, 32, 512, 8192
TARGET = 1.05  # decode at batch 1 and 16: invariant / default


def parser() -> OneLineParser:
    p = OneLineParser(prog="l14_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=list(MODELS))
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch-invariant", default="both", choices=("both", "on", "off"),
                   help="which modes to time (default: both, and their ratio)")
    p.add_argument("--requests", type=int, default=64, help="requests in the L4-style run (0 skips it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    return p


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    return [job.prompt_ids for job in bs.make_workload(n, (length, length), (1, 1), vocab, seed)]


def decode(model, invariant: bool, batch: list[list[int]]) -> float:
    """ms per decode step, the prompts prefilled first (untimed)."""
    engine = L14Engine(model, 16, max_running=len(batch), batch_invariant=invariant, max_batched_tokens=PREFILL)
    seqs = [engine.add_request(p, StopRule(DECODE_STEPS + 1, ignore_eos=True)) for p in batch]
    while not all(s.output_ids for s in seqs):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    return 1e3 * (time.perf_counter() - t0) / DECODE_STEPS


def prefill(model, invariant: bool, prompt: list[int]) -> float:
    engine = L14Engine(model, 16, batch_invariant=invariant, max_batched_tokens=len(prompt))
    engine.add_request(prompt, StopRule(1, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()
    return 1e3 * (time.perf_counter() - t0)


def l4_run(model, invariant: bool, jobs: list) -> float:
    engine = L14Engine(model, 16, KV_TOKENS // 16, max_running=64, batch_invariant=invariant)
    return bs.paged(engine, "L14", jobs, lambda n: None).seconds


def run(args, console: Console) -> int:
    if args.rounds < 1:
        raise CourseError(f"--rounds must be at least 1, got {args.rounds}")
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    model = Qwen3ForCausalLM.from_dir(MODELS[args.model](), dtype, torch.device("cpu"))
    vocab = model.config.vocab_size
    modes = [m for m in MODES if args.batch_invariant == "both" or MODES[m] == (args.batch_invariant == "on")]
    conditions = harness.start("cpu", dtype, backend="cpp")
    conditions.extra.update(model=args.model, rounds=str(args.rounds))
    measures: dict[str, Callable[[bool], float]] = {
        "decode, batch 1 (ms/step)": lambda inv: decode(model, inv, prompts(1, PROMPT, vocab, args.seed)),
        "decode, batch 16 (ms/step)": lambda inv: decode(model, inv, prompts(16, PROMPT, vocab, args.seed)),
        f"prefill, {PREFILL} tokens (ms)": lambda inv: prefill(model, inv, prompts(1, PREFILL, vocab, args.seed)[0]),
    }
    if args.requests:
        jobs = bs.make_workload(args.requests, (32, 512), (16, 128), vocab, args.seed)
        measures[f"L4-style run, {args.requests} requests (s)"] = lambda inv: l4_run(model, inv, jobs)
    rows, report = [], {}
    with torch.inference_mode():
        for name, measure in measures.items():
            times: dict[str, list[float]] = {m: [] for m in modes}
            for _, mode in harness.alternate(modes, args.rounds):
                times[mode].append(measure(MODES[mode]))
            median = {m: statistics.median(t) for m, t in times.items()}
            ratio = median["invariant"] / median["default"] if len(modes) == 2 else None
            report[name] = {"median": median, "rounds": times, "ratio": ratio}
            rows.append([name, *(f"{median[m]:,.2f}" for m in modes)] + ([f"{ratio:.2f}x"] if ratio else []))
            console.print(f"  {name}: " + ", ".join(f"{m} {median[m]:,.2f}" for m in modes), highlight=False)
    columns = ["measurement", *modes] + (["invariant / default"] if len(modes) == 2 else [])
    console.print(harness.table(f"L14: the batch-invariant mode's cost ({args.model}, {args.dtype}, median of "
                                f"{args.rounds} rounds)", columns, rows))
    decodes = {b: report.get(f"decode, batch {b} (ms/step)", {}).get("ratio") for b in (1, 16)}
    if None not in decodes.values():
        met = "met" if max(decodes.values()) <= TARGET else "NOT met"
        console.print(f"target: decode at batch 1 and 16 within {TARGET}x the default mode's time: "
                      f"{decodes[1]:.2f}x and {decodes[16]:.2f}x, {met}")
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"results": report}, conditions, console)
    return 0


if __name__ == "__main__":
    exit_with(lambda: run(parser().parse_args(), Console()))

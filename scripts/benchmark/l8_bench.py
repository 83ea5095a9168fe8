"""Chunked prefill under load: long prompts arriving among decoding short requests, on L7 (every prompt
prefilled whole, in one step) and on L8 at several token budgets, all in one invocation.

    OMP_NUM_THREADS=1 python scripts/benchmark/l8_bench.py [--quick] [--budgets 32,64,...] [--repeats N]
        [--backend auto] [--late-shorts N] [--max-long-prefills K --long-prefill-threshold T] [--json PATH] ...

Workload (seeded, the same for every engine): --shorts short requests (prompts of 16-64 random token ids,
32-64 new tokens, EOS ignored), --longs long prompts of --long-len tokens (16 new tokens each), and
--late-shorts more short ones, each right after a long prompt. Random ids from 1000..min(100000, vocab): no
two prompts share a block, so the prefix cache does not hit (a note says if it did). Arrivals follow the
short requests' progress (their output tokens in total), not step numbers, which differ between L7 and L8:
short i arrives once they have produced 3 * i tokens, long prompt j at a fraction of their total output
spaced over 0.15 .. 0.6, so every long prompt lands while most short requests are mid-decode.

Every engine: the same pool (every request fits at once: no preemption), block size 16, graphs on, a fresh
engine per timed run warmed up on a small run of its own; rounds alternate the engines' order
(harness.alternate) and percentiles pool all rounds. A token is stamped when its step returns (after a CUDA
synchronize on a GPU); L8's own engine.timing must agree, step for step. Reported per engine, also as a
ratio to L7's: TTFT p50/p99 of short and long requests, the short requests' inter-token gap p50/p99 and
longest gap (seconds and steps), throughput (output tokens / wall seconds). Greedy tokens must equal L7's
(else FAIL, exit 1). With --max-long-prefills K --long-prefill-threshold T every budget also runs with L8's
long-prompt limit (those rows stay out of the target and the plot).

Target (a benchmark, not a test): at some budget, a p99 inter-token gap of the short requests at most 1/3
of L7's with throughput at least 90% of L7's. The PNG plots p99 gap against throughput, one point per
budget (default: <course cache>/bench/l8_budget_sweep.png). The conditions line (commit, CPU, threads, the
attention backend the engines really used, load) is printed before the table.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark's own modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's lessons/ and shared/, not an installed course's
import harness  # noqa: E402
from lessons.l2_token_flat.engine import blocks_for  # noqa: E402
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l7_cuda_graphs import L7Engine  # noqa: E402
from lessons.l8_chunked_prefill import L8Engine  # noqa: E402
from lessons.l8_chunked_prefill.scheduler import check_long_prefills  # noqa: E402
from shared.cli import OneLineParser, resolve_device, resolve_dtype, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule, check_prompt  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import cache_root, default_model_dir  # noqa: E402

FULL = {"budgets": "32,64,128,256,512,1024,2048", "shorts": 12, "longs": 3, "long_len": (1500, 3000), "repeats": 2}
QUICK = {"budgets": "64,512", "shorts": 6, "longs": 2, "long_len": (1500, 2000), "repeats": 1}
SHORT_PROMPT, SHORT_NEW, LONG_NEW = (16, 64), (32, 64), 16
SHORT_EVERY = 3  # short i arrives once the shorts have produced 3 * i tokens
LONG_AT = (0.15, 0.6)  # long prompts arrive at fractions of the shorts' total output, evenly spaced over this
TOKEN_LO, TOKEN_HI = 1000, 100000
GAP_TARGET, THROUGHPUT_TARGET = 1 / 3, 0.9


@dataclass(frozen=True)
class Job:
    kind: str  # "short" | "long"
    prompt_ids: list[int]
    new_tokens: int
    milestone: int  # submitted once the short requests have produced this many tokens in total


@dataclass
class Trace:
    """One request as the benchmark saw it: when it was submitted, and the step and time of each token."""
    job: Job
    seq: object
    arrival_step: int
    arrival_s: float
    token_steps: list[int] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)


def make_jobs(rng: random.Random, shorts: int, longs: int, long_len: tuple[int, int], vocab: int,
              late_shorts: int = 0) -> list[Job]:
    hi = min(TOKEN_HI, vocab)
    ids = lambda n: [rng.randrange(TOKEN_LO, hi) for _ in range(n)]  # noqa: E731
    jobs = [Job("short", ids(rng.randint(*SHORT_PROMPT)), rng.randint(*SHORT_NEW), SHORT_EVERY * i) for i in range(shorts)]
    total = sum(j.new_tokens for j in jobs)
    fractions = np.linspace(*LONG_AT, longs) if longs > 1 else [LONG_AT[0]]
    jobs += [Job("long", ids(rng.randint(*long_len)), LONG_NEW, round(f * total)) for f in fractions[:longs]]
    at = [j.milestone for j in jobs if j.kind == "long"] or [0]
    # Drawn after the others, so the rest of the workload is the same with or without them.
    jobs += [Job("short", ids(rng.randint(*SHORT_PROMPT)), rng.randint(*SHORT_NEW), at[i % len(at)])
             for i in range(late_shorts)]
    return jobs


def drive(engine: L7Engine, jobs: list[Job], sync) -> tuple[list[Trace], float, int]:
    """Submit each job at its milestone, step until all finish, stamp every token. (traces, seconds, steps)"""
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].milestone, i))
    traces: list[Trace | None] = [None] * len(jobs)
    k, progress, clock0 = 0, 0, engine.clock
    t0 = time.perf_counter()
    while k < len(order) or engine.scheduler.has_work():
        while k < len(order) and (jobs[order[k]].milestone <= progress or not engine.scheduler.has_work()):
            job = jobs[order[k]]
            seq = engine.add_request(job.prompt_ids, StopRule(job.new_tokens, frozenset(), ignore_eos=True))
            traces[order[k]] = Trace(job, seq, engine.clock, time.perf_counter())
            k += 1
        engine.step()
        sync()
        now = time.perf_counter()
        for t in traces:
            if t is not None and len(t.seq.output_ids) > len(t.token_s):
                for _ in range(len(t.seq.output_ids) - len(t.token_s)):
                    t.token_steps.append(engine.clock)
                    t.token_s.append(now)
                    progress += t.job.kind == "short"
    return traces, time.perf_counter() - t0, engine.clock - clock0  # type: ignore[return-value]


@dataclass
class Run:
    traces: list[Trace]
    seconds: float
    steps: int
    notes: list[str]
    backend: str  # the attention backend the engine really used


def run_once(make, jobs: list[Job], warm: list[Job], sync) -> Run:
    """A fresh engine, warmed up on a small run of its own (first-call costs land there, untimed), then timed."""
    engine = make()
    drive(engine, warm, sync)
    before = (engine.stats.preemptions, engine.stats.cached_tokens, len(getattr(engine, "step_tokens", [])))
    traces, seconds, steps = drive(engine, jobs, sync)
    notes = []
    if engine.stats.preemptions > before[0] or engine.stats.cached_tokens > before[1]:
        notes.append(f"{engine.stats.preemptions - before[0]} preemption(s), "
                     f"{engine.stats.cached_tokens - before[1]} prompt tokens from the prefix cache")
    if isinstance(engine, L8Engine):
        for t in traces:  # L8 stamps its own timing: it must agree with ours, step for step
            own = engine.timing[t.seq.seq_id]
            if own.token_steps != t.token_steps or own.arrival_step != t.arrival_step:
                notes.append(f"engine.timing of request {t.seq.seq_id} disagrees with the benchmark's stamps")
        over = max(engine.step_tokens[before[2]:], default=0)
        if over > engine.max_batched_tokens:
            notes.append(f"a step computed {over} tokens, over the budget {engine.max_batched_tokens}")
    return Run(traces, seconds, steps, notes, harness.backend_name(engine))


RATIO_KEYS = ("tokens_per_s", "short_ttft_p50_s", "short_ttft_p99_s", "long_ttft_p50_s", "long_ttft_p99_s",
              "short_gap_p50_s", "short_gap_p99_s", "short_gap_max_s", "wall_s")


def summarize(name: str, budget: int | None, runs: list[Run], jobs: list[Job]) -> dict:
    """Percentiles over every round's samples pooled; throughput = all tokens / all wall seconds; tokens, wall
    and steps: the mean per run."""
    ttft: dict[str, list[float]] = {"short": [], "long": []}
    gaps, gap_steps, tokens = [], [], 0
    for r in runs:
        for t in r.traces:
            tokens += len(t.token_s)
            ttft[t.job.kind].append(t.token_s[0] - t.arrival_s)
            if t.job.kind == "short":
                gaps += [b - a for a, b in zip(t.token_s, t.token_s[1:])]
                gap_steps += [b - a for a, b in zip(t.token_steps, t.token_steps[1:])]
    wall, n = sum(r.seconds for r in runs), len(runs)
    pct = lambda values, prefix: {f"{prefix}_{q}_s": v for q, v in harness.percentiles(values, (50, 99)).items()}  # noqa: E731
    outputs = [[list(t.seq.output_ids) for t in r.traces] for r in runs]
    complete = all(len(out) == j.new_tokens for run in outputs for out, j in zip(run, jobs))
    return {"engine": name, "budget": budget, "tokens": tokens // n, "wall_s": wall / n,
            "steps": sum(r.steps for r in runs) / n, "tokens_per_s": tokens / wall,
            **pct(ttft["short"], "short_ttft"), **pct(ttft["long"], "long_ttft"), **pct(gaps, "short_gap"),
            "short_gap_max_s": max(gaps, default=None), "short_gap_max_steps": max(gap_steps, default=None),
            "notes": sorted({note for r in runs for note in r.notes}), "outputs": outputs[0],
            "_parity": (complete, outputs),
            "rounds": [{"wall_s": r.seconds, "steps": r.steps, "requests": [
                {"kind": t.job.kind, "arrival_step": t.arrival_step, "token_steps": t.token_steps,
                 "token_s": [x - t.arrival_s for x in t.token_s]} for t in r.traces]} for r in runs]}


def fmt_s(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.0f} ms" if v < 10 else f"{v:.1f} s"


COLUMNS = [("steps/run", None), ("wall/run", "wall_s"), ("throughput", "tokens_per_s"),
           ("short TTFT p50", "short_ttft_p50_s"), ("short TTFT p99", "short_ttft_p99_s"),
           ("long TTFT p50", "long_ttft_p50_s"), ("long TTFT p99", "long_ttft_p99_s"),
           ("short gap p50", "short_gap_p50_s"), ("short gap p99", "short_gap_p99_s"), ("max gap", "short_gap_max_s")]


def cells(r: dict) -> list[str]:
    """One table row: each cell the value and, below it, the ratio to L7's."""
    out = [r["engine"], f"{r['steps']:.0f}"]
    for _, key in COLUMNS[1:]:
        value, ratio = r[key], r["x_l7"][key]
        shown = {"tokens_per_s": f"{value:.1f} tok/s", "wall_s": f"{value:.1f} s"}.get(key) or fmt_s(value)
        if key == "short_gap_max_s":
            shown += f" / {r['short_gap_max_steps']} st"
        out.append(f"{shown}\n[bold]{ratio:.2f}x[/]" if ratio is not None else shown)
    return out + ["[green]same[/]" if r["parity"] else "[red]FAIL[/]"]


def target(rows: list[dict]) -> dict:
    """Budgets meeting the target; the best of them (lowest p99 gap), or if none, the closest: the lowest gap
    among those keeping throughput, else the highest throughput."""
    sweep = [r for r in rows[1:] if r["parity"] and r["long_limit"] is None]  # a wrong engine meets nothing
    gap = lambda r: r["x_l7"]["short_gap_p99_s"]  # noqa: E731
    tput = lambda r: r["x_l7"]["tokens_per_s"]  # noqa: E731
    kept = [r for r in sweep if tput(r) >= THROUGHPUT_TARGET]
    met = [r for r in kept if gap(r) <= GAP_TARGET]
    best = min(met or kept, key=gap) if kept else max(sweep, key=tput, default=None)
    return {"met": bool(met), "budgets": [r["budget"] for r in met],
            "best": None if best is None else {"budget": best["budget"], "gap_p99_x_l7": gap(best),
                                               "throughput_x_l7": tput(best)}}


def plot(report: dict, path: Path, conditions: harness.Conditions, console: Console) -> Path:
    l7, sweep = report["engines"][0], [r for r in report["engines"][1:] if r["long_limit"] is None]
    xs = [r["x_l7"]["tokens_per_s"] for r in sweep]
    ys = [r["short_gap_p99_s"] * 1e3 for r in sweep]
    l7_y = l7["short_gap_p99_s"] * 1e3
    fig, ax = harness.figure(figsize=(8, 5.2))
    ax.set_yscale("log")
    lo_x, hi_x = min(xs + [1.0, THROUGHPUT_TARGET]) - 0.08, max(xs + [1.0]) + 0.08
    lo_y, hi_y = min(ys + [l7_y]) / 2, max(ys + [l7_y]) * 2
    ax.fill_between([THROUGHPUT_TARGET, hi_x], lo_y, l7_y * GAP_TARGET, color="tab:green", alpha=0.12,
                    label="target: p99 gap ≤ 1/3 of L7's, throughput ≥ 0.9× L7's")
    ax.axhline(l7_y * GAP_TARGET, color="tab:green", lw=0.8, ls="--")
    ax.axvline(THROUGHPUT_TARGET, color="tab:green", lw=0.8, ls=":")
    ax.plot(xs, ys, "-o", color="tab:blue", label="L8, each point labelled with its token budget")
    for x, y, r in zip(xs, ys, sweep):
        ax.annotate(f"{r['budget']}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=9)
    ax.plot([1.0], [l7_y], "*", color="tab:red", ms=14, label="L7 (each prompt prefilled whole)")
    ax.annotate("L7", (1.0, l7_y), textcoords="offset points", xytext=(8, -4), fontsize=9, color="tab:red")
    ax.set_xlim(lo_x, hi_x)
    ax.set_ylim(lo_y, hi_y)
    ax.set_xlabel("throughput ÷ L7's (output tokens per second, same invocation)")
    ax.set_ylabel("p99 inter-token gap of the short requests (ms, log scale)")
    w = report["workload"]
    ax.set_title(f"L8 token-budget sweep ({Path(report['model']).name}, {conditions.device}, backend "
                 f"{conditions.backend}, {conditions.threads} thread(s))\n{w['shorts']} short requests decoding, "
                 f"{w['longs']} long prompts of {'/'.join(str(n) for n in w['long_prompt_tokens'])} tokens arriving",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(True, which="both", alpha=0.25)
    fig.tight_layout()
    return harness.save_png(fig, path, conditions, console)


def parser() -> OneLineParser:
    p = OneLineParser(prog="l8_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", help=f"comma-separated L8 token budgets (default: {FULL['budgets']}; quick: {QUICK['budgets']})")
    p.add_argument("--shorts", type=int, help=f"short requests (default: {FULL['shorts']}; quick: {QUICK['shorts']})")
    p.add_argument("--longs", type=int, help=f"long prompts (default: {FULL['longs']}; quick: {QUICK['longs']})")
    p.add_argument("--long-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help=f"long prompt tokens (default: {FULL['long_len']}; quick: {QUICK['long_len']})")
    p.add_argument("--quick", action="store_true", help="a smaller run (about 30 s on one CPU thread)")
    p.add_argument("--repeats", type=int, help=f"timed runs per engine, samples pooled (default: {FULL['repeats']}; "
                   f"quick: {QUICK['repeats']})")
    p.add_argument("--late-shorts", type=int, default=0, help="short requests submitted right after the long prompts "
                   "(default: 0)")
    p.add_argument("--max-long-prefills", type=int, help="also run every budget with this limit on long prompts "
                   "part-way through (needs --long-prefill-threshold)")
    p.add_argument("--long-prefill-threshold", type=int, help="with --max-long-prefills: what counts as long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; OMP_NUM_THREADS=1 or 1 "
                   "gives the most stable numbers)")
    p.add_argument("--model", help="HF-format Qwen3 checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--png", metavar="PATH", help="the sweep picture (default: <course cache>/bench/l8_budget_sweep.png)")
    p.add_argument("--no-png", action="store_true", help="draw no picture")
    return p


def settings(args) -> None:
    """Fill what --quick or the full run decides, then check everything before the first engine runs."""
    base = QUICK if args.quick else FULL
    for key in ("budgets", "shorts", "longs", "long_len", "repeats"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    try:
        args.budgets = [int(b) for b in str(args.budgets).split(",")]
    except ValueError:
        raise CourseError(f"--budgets {args.budgets!r}: use comma-separated integers")
    if any(b < 1 for b in args.budgets):
        raise CourseError(f"--budgets: every budget must be at least 1, got {args.budgets}")
    for name, least in (("shorts", 1), ("repeats", 1), ("block_size", 1), ("longs", 0), ("late_shorts", 0),
                        ("threads", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise CourseError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    check_long_prefills(args.max_long_prefills, args.long_prefill_threshold)
    if not 1 <= args.long_len[0] <= args.long_len[1]:
        raise CourseError(f"--long-len needs 1 <= MIN <= MAX, got {args.long_len[0]} {args.long_len[1]}")
    if not args.no_png:
        try:
            import matplotlib  # noqa: F401  (fail before the run, not after it)
        except ImportError:
            raise CourseError("the sweep picture needs matplotlib: pip install matplotlib, or pass --no-png")


def main() -> None:
    args = parser().parse_args()
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        settings(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        model_dir = resolve_model_dir(args.model, default_model_dir)
        model = Qwen3ForCausalLM.from_dir(model_dir, dtype, device)
        vocab = model.config.vocab_size
        if vocab <= TOKEN_LO:
            raise CourseError(f"the model's vocabulary ({vocab}) is too small for token ids from {TOKEN_LO}")
        rng = random.Random(args.seed)
        jobs = make_jobs(rng, args.shorts, args.longs, tuple(args.long_len), vocab, args.late_shorts)
        warm = [Job("short", [rng.randrange(TOKEN_LO, min(TOKEN_HI, vocab)) for _ in range(n)], new, 0)
                for n, new in ((24, 4), (40, 4), (min(400, args.long_len[0]), 2))]
        for job in jobs:  # a request past the model's context fails here, before any engine runs
            check_prompt(job.prompt_ids, StopRule(job.new_tokens), model.config)
        num_blocks = sum(blocks_for(len(j.prompt_ids) + j.new_tokens, args.block_size) for j in jobs + warm) + len(jobs)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        common = (model, args.block_size, num_blocks, 64, args.backend)
        conditions = harness.start(device, dtype, backend=args.backend)
        conditions.extra["model"] = "embedded" if args.model is None else args.model
        longs = [len(j.prompt_ids) for j in jobs if j.kind == "long"]
        console.print(f"[bold]L8 chunked-prefill benchmark[/]: seed {args.seed}, {args.repeats} timed run(s) per engine")
        console.print(f"  workload: {args.shorts} short requests (prompts {SHORT_PROMPT[0]}-{SHORT_PROMPT[1]} tokens, "
                      f"{SHORT_NEW[0]}-{SHORT_NEW[1]} new), short i submitted once the shorts produced {SHORT_EVERY}*i "
                      f"tokens; {args.longs} long prompts of {', '.join(map(str, longs))} tokens ({LONG_NEW} new each) "
                      f"submitted at {', '.join(str(j.milestone) for j in jobs if j.kind == 'long')} of the shorts' "
                      f"{sum(j.new_tokens for j in jobs if j.kind == 'short')} tokens; pool {num_blocks} blocks of "
                      f"{args.block_size} (every request fits at once)"
                      + (f"; {args.late_shorts} more short requests, each right after a long prompt" if args.late_shorts
                         else ""))
        t0 = time.perf_counter()
        engines = [("L7 (whole prompts)", None, lambda: L7Engine(*common, graphs=True))]
        for b in args.budgets:
            engines.append((f"L8 budget {b}", b, lambda b=b: L8Engine(*common, graphs=True, max_batched_tokens=b)))
            if args.max_long_prefills:
                limit, t = args.max_long_prefills, args.long_prefill_threshold
                engines.append((f"L8 budget {b}, long prompts (> {t}) <= {limit}", b, lambda b=b: L8Engine(
                    *common, graphs=True, max_batched_tokens=b, max_long_prefills=limit, long_prefill_threshold=t)))
        runs: dict[str, list[Run]] = {name: [] for name, _, _ in engines}
        with torch.inference_mode():
            for k, (name, _, make) in harness.alternate(engines, args.repeats):
                run = run_once(make, jobs, warm, sync)
                runs[name].append(run)
                console.print(f"  round {k + 1}/{args.repeats}, {name}: {run.steps} steps, {run.seconds:.1f} s")
        conditions.backend = ",".join(sorted({r.backend for rs in runs.values() for r in rs}))
        rows = [summarize(name, budget, runs[name], jobs) for name, budget, _ in engines]
        for row in rows:
            row["long_limit"] = (None if "long prompts" not in row["engine"]
                                 else {"max_long_prefills": args.max_long_prefills,
                                       "long_prefill_threshold": args.long_prefill_threshold})
        wall = time.perf_counter() - t0
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    base = rows[0]
    for r in rows:
        r["x_l7"] = {k: (r[k] / base[k] if r[k] is not None and base[k] else None) for k in RATIO_KEYS}
        complete, outputs = r.pop("_parity")
        r["parity"] = complete and outputs == [base["outputs"]] * args.repeats
    harness.finish(conditions, console)
    console.print(harness.table(f"Long prompts among decoding short requests: L7 vs L8 token budgets ({len(jobs)} "
                                f"requests, {base['tokens']} output tokens per run)",
                                ["engine", *(name for name, _ in COLUMNS), "parity"], [cells(r) for r in rows]))
    console.print("  each cell: the value, and below it the ratio to L7's (throughput: higher is better; times: lower "
                  "is better); max gap: the longest wait between two tokens of a short request, in seconds / in steps")
    goal = target(rows)
    if goal["met"]:
        console.print(f"target [green]met[/] at budget(s) {', '.join(map(str, goal['budgets']))}: short requests' p99 "
                      f"gap ≤ 1/3 of L7's with throughput ≥ {THROUGHPUT_TARGET:.0%} of L7's")
    elif goal["best"]:
        b = goal["best"]
        console.print(f"target [red]not met[/] (p99 gap ≤ 1/3 of L7's with throughput ≥ {THROUGHPUT_TARGET:.0%}); "
                      f"closest: budget {b['budget']}, p99 gap {b['gap_p99_x_l7']:.2f}x, throughput {b['throughput_x_l7']:.2f}x")
    for r in rows:
        for note in r["notes"]:
            console.print(f"  [yellow]{r['engine']}: {note}[/]")
    report = {"model": str(model_dir), "seed": args.seed, "repeats": args.repeats, "wall_seconds": wall,
              "num_blocks": num_blocks, "block_size": args.block_size,
              "workload": {"shorts": args.shorts, "longs": args.longs, "long_prompt_tokens": longs,
                           "late_shorts": args.late_shorts,
                           "jobs": [{"kind": j.kind, "prompt_tokens": len(j.prompt_ids), "new_tokens": j.new_tokens,
                                     "submitted_at_short_tokens": j.milestone} for j in jobs]},
              "engines": rows, "target": goal}
    if not args.no_png:
        report["png"] = str(plot(report, Path(args.png) if args.png else cache_root() / "bench" / "l8_budget_sweep.png",
                                 conditions, console))
    if args.json:
        harness.write_json(args.json, report, conditions, console)
    console.print(f"wall time {wall:.0f} s")
    failed = [r["engine"] for r in rows if not r["parity"]]
    if failed:
        console.print(f"[red]FAIL[/]: greedy tokens differ from L7's on {', '.join(failed)}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()

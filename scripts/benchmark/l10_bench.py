"""Tensor parallelism on this machine: the same seeded workload on L10's engine at tp 1 and tp 2 (one
invocation), per engine step, and the KV capacity per rank that a split buys in a fixed memory budget.

    OMP_NUM_THREADS=1 python scripts/benchmark/l10_bench.py [--tp-sizes 1,2] [--requests 8] [--prompt-len 192 384]
        [--new-tokens 32] [--repeats 3] [--seed 0] [--kv-mib 64] [--kv-tp-sizes 1,2,4] [--threads N]
        [--max-batched-tokens 64] [--model DIR] [--device cpu] [--dtype float32] [--json PATH]

The default run takes about 25 s on the course's 2-core machine; the timed runs are about 13 s of it, the rest
is starting processes, loading and warming up.

Only one torch.distributed group can live in a process, so each tp size runs in a fresh child process of
this script (a hidden --child mode that prints one JSON line); the parent runs them one after another, never
together, and compares them. In a child, rank 0 is the child itself and L10's launch spawns ranks 1..tp-1,
each with rank 0's torch thread count: tp 2 at one thread per rank keeps both of a 2-core machine's cores busy.

The workload (seeded, the same at every tp): --requests prompts of --prompt-len random token ids
(1000..min(100000, vocab), so no two prompts share a block and the prefix cache does not hit), --new-tokens
each, greedy, end-of-sequence ignored, all submitted at once. The pool fits every request (no preemption);
the token budget is L8's (--max-batched-tokens), so prompts go in slices among the decode rows. Each timed
run gets a fresh engine, warmed up first on three small requests of its own (graph captures and first calls
land there, untimed). --repeats timed runs per tp; step times pool over them.

Reported per tp, from rank 0 (the process that runs the scheduler): engine steps per run; mean step time,
also split into steps carrying a prompt slice and decode-only steps; all-reduces per step (2 per layer + the
embedding's) and the mean time of one; the share of the timed run's wall time rank 0 spent in all-reduces,
in the LM head's gather and in broadcasting each step to the followers (TpGroup.seconds: waits for the
slower rank included); what is left of a step for everything else; output tokens/s and computed (prompt +
decode) tokens/s. Each as a ratio to the first tp size's. The greedy tokens at every tp must equal the first
tp size's, request for request: a mismatch prints FAIL, exit status 1.

KV capacity is arithmetic, no processes: for each of --kv-tp-sizes, rank 0's TpLayout, its local config
(layout.local_config: its KV heads), the bytes of one block of S tokens on one rank, and how many blocks
--kv-mib holds. Past tp = Hkv the KV heads are replicated (TpLayout), so the blocks per rank stop growing.
For the tp sizes that ran, each child's measured pool (runner.pool.bytes() / its blocks) is checked
against this arithmetic.

What it shows: on a 2-core CPU, tp 2 is slower than tp 1. Each rank's matmuls halve, but they were small
to begin with; every forward adds 2 * layers + 1 all-reduces, each a round trip between processes over
gloo's loopback TCP, plus the step's broadcast and the logits' gather. Tensor parallelism here teaches
correctness (the same tokens from split weights), not speed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark's own modules
import bench_conditions  # noqa: E402
from lessons.l2_token_flat.engine import blocks_for  # noqa: E402
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING  # noqa: E402
from lessons.l8_chunked_prefill.scheduler import DEFAULT_MAX_BATCHED_TOKENS  # noqa: E402
from lessons.l10_tensor_parallel.group import DEFAULT_TIMEOUT_S, TpGroup  # noqa: E402
from lessons.l10_tensor_parallel.layout import TpLayout, check_tp  # noqa: E402
from shared.cli import OneLineParser, resolve_device, resolve_dtype, resolve_model_dir  # noqa: E402
from shared.config import Qwen3Config  # noqa: E402
from shared.errors import CourseError, RunFailure  # noqa: E402
from shared.generation import StopRule, check_prompt  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

TOKEN_LO, TOKEN_HI = 1000, 100000
WARM = ((24, 4), (40, 4), (150, 2))  # (prompt tokens, new tokens) of the untimed warm-up requests
CHILD_MARK = "L10_BENCH_CHILD "  # the child's one line of results on stdout starts with this
COLLECTIVES = ("all-reduce", "gather", "broadcast")
MIB = 1024**2


def make_jobs(seed: int, repeat: int, n: int, lengths: tuple[int, int], new: int,
              vocab: int) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) per request; warm-up requests are repeat -1. The same at every tp."""
    rng = random.Random(f"{seed}/{repeat}")
    hi = min(TOKEN_HI, vocab)
    if repeat < 0:
        return [([rng.randrange(TOKEN_LO, hi) for _ in range(p)], k) for p, k in WARM]
    return [([rng.randrange(TOKEN_LO, hi) for _ in range(rng.randint(*lengths))], new) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- the child


def drive(engine, group: TpGroup, jobs: list[tuple[list[int], int]]) -> dict:
    """Submit every job at once, step until all finish; per step: its time, whether it carried a prompt slice,
    the tokens it computed, and rank 0's collectives in it."""
    seqs = [engine.add_request(ids, StopRule(new, frozenset(), ignore_eos=True)) for ids, new in jobs]
    steps = []
    t_run = time.perf_counter()
    while engine.scheduler.has_work():
        cached = [s.num_cached for s in seqs]
        calls, seconds = dict(group.calls), dict(group.seconds)
        computed = len(engine.step_tokens)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        prefill = any(before < len(s.prompt_ids) and s.num_cached > before for s, before in zip(seqs, cached))
        steps.append({"s": dt, "prefill": prefill,
                      "tokens": engine.step_tokens[-1] if len(engine.step_tokens) > computed else 0,
                      "calls": {c: group.calls[c] - calls.get(c, 0) for c in COLLECTIVES},
                      "seconds": {c: group.seconds[c] - seconds.get(c, 0.0) for c in COLLECTIVES}})
    wall = time.perf_counter() - t_run
    return {"wall_s": wall, "steps": steps, "outputs": [list(s.output_ids) for s in seqs]}


def child(args) -> None:
    from lessons.l10_tensor_parallel import L10Engine
    from lessons.l10_tensor_parallel.launch import start
    from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    tp = args.child
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model_dir = resolve_model_dir(args.model, default_model_dir)
    cfg = Qwen3Config.from_dir(model_dir)
    check_tp(cfg, tp)
    warm = make_jobs(args.seed, -1, 0, (0, 0), 0, cfg.vocab_size)
    runs_jobs = [make_jobs(args.seed, r, args.requests, tuple(args.prompt_len), args.new_tokens, cfg.vocab_size)
                 for r in range(args.repeats)]
    num_blocks = max(sum(blocks_for(len(ids) + new, args.block_size) for ids, new in jobs)
                     for jobs in runs_jobs + [warm])
    num_blocks += args.requests  # slack: a decode row may open its next block before another request ends
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    group = start(tp, device, args.tp_timeout)
    model = TpQwen3ForCausalLM.load(model_dir, dtype, group)
    ready_s = time.perf_counter() - t0
    runs = []
    try:
        with torch.inference_mode():
            for jobs in runs_jobs:
                engine = L10Engine(model, args.block_size, num_blocks, args.max_running, args.backend, graphs=True,
                                   max_batched_tokens=args.max_batched_tokens)
                drive(engine, group, warm)
                hits = engine.stats.cached_tokens, engine.stats.preemptions
                run = drive(engine, group, jobs)
                run["cached_tokens"] = engine.stats.cached_tokens - hits[0]
                run["preemptions"] = engine.stats.preemptions - hits[1]
                runs.append(run)
        pool = engine.runner.pool
        weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}  # tied: one tensor
        result = {"tp": tp, "threads_per_rank": torch.get_num_threads(), "load1_at_start": load_before,
                  "ready_s": ready_s, "num_blocks": num_blocks, "pool_bytes": pool.bytes(),
                  "pool_blocks": pool.num_blocks, "weights_bytes_per_rank": sum(weights.values()),
                  "forward_all_reduces": 2 * cfg.num_hidden_layers + 1, "runs": runs}
    finally:
        group.close()  # what L10Engine.close() does: the followers stop, the process groups go
    print(CHILD_MARK + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------- the parent


def run_child(tp: int, argv: list[str], timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", str(tp)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RunFailure(f"tp {tp}: the child process ran past {timeout:g} s")
    lines = [line for line in p.stdout.splitlines() if line.startswith(CHILD_MARK)]
    if p.returncode != 0 or not lines:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-5:])
        raise RunFailure(f"tp {tp}: the child process exited {p.returncode}:\n{tail}")
    return json.loads(lines[-1].removeprefix(CHILD_MARK))


def summarize(res: dict) -> dict:
    steps = [s for run in res["runs"] for s in run["steps"]]
    wall = sum(run["wall_s"] for run in res["runs"])
    n = len(steps)
    calls = {c: sum(s["calls"][c] for s in steps) for c in COLLECTIVES}
    secs = {c: sum(s["seconds"][c] for s in steps) for c in COLLECTIVES}
    prefill = [s["s"] for s in steps if s["prefill"]]
    decode = [s["s"] for s in steps if not s["prefill"]]
    out_tokens = sum(len(o) for run in res["runs"] for o in run["outputs"])
    computed = sum(s["tokens"] for s in steps)
    return {"tp": res["tp"], "steps_per_run": n / len(res["runs"]), "wall_s_per_run": wall / len(res["runs"]),
            "step_ms": 1e3 * wall / n, "prefill_step_ms": 1e3 * statistics.fmean(prefill) if prefill else None,
            "decode_step_ms": 1e3 * statistics.fmean(decode) if decode else None,
            "prefill_steps_per_run": len(prefill) / len(res["runs"]),
            "decode_steps_per_run": len(decode) / len(res["runs"]),
            "all_reduces_per_step": calls["all-reduce"] / n,
            "all_reduce_ms": 1e3 * secs["all-reduce"] / calls["all-reduce"] if calls["all-reduce"] else None,
            **{f"{c.replace('-', '_')}_share": secs[c] / wall for c in COLLECTIVES},
            "other_step_ms": 1e3 * (wall - sum(secs.values())) / n,
            "output_tokens_per_s": out_tokens / wall, "computed_tokens_per_s": computed / wall,
            "collective_calls": calls, "collective_seconds": secs}


RATIO_KEYS = ("step_ms", "prefill_step_ms", "decode_step_ms", "other_step_ms", "output_tokens_per_s",
              "computed_tokens_per_s")


def kv_capacity(cfg: Qwen3Config, tp_sizes: list[int], block_size: int, dtype_bytes: int, budget: int) -> list[dict]:
    """Rank 0's share of the KV in `budget` bytes per rank, from its TpLayout alone (no process starts)."""
    rows = []
    for tp in tp_sizes:
        try:
            check_tp(cfg, tp)
        except CourseError as e:
            rows.append({"tp": tp, "refused": str(e)})
            continue
        layout = TpLayout.of(cfg, 0, tp)
        local = layout.local_config(cfg)
        per_block = block_size * local.kv_bytes_per_token(dtype_bytes)
        blocks = budget // per_block
        rows.append({"tp": tp, "q_heads": len(layout.q_heads), "kv_heads": len(layout.kv_heads),
                     "replicated": tp > cfg.num_key_value_heads, "block_bytes": per_block, "blocks": blocks,
                     "tokens": blocks * block_size})
    return rows


def fmt(v: float | None, unit: str = "", digits: int = 1) -> str:
    return "—" if v is None else f"{v:,.{digits}f}{unit}"


def show_steps(console: Console, rows: list[dict], title: str) -> None:
    t = Table(title=title)
    cols = [("tp", None), ("steps/run", None), ("step", "step_ms"), ("with slice", "prefill_step_ms"),
            ("decode only", "decode_step_ms"), ("AR/step", None), ("one AR", None), ("AR", None), ("gather", None),
            ("bcast", None), ("rest", "other_step_ms"), ("out tok/s", "output_tokens_per_s"),
            ("all tok/s", "computed_tokens_per_s"), ("parity", None)]
    for name, _ in cols:
        t.add_column(name, justify="right")
    for r in rows:
        def cell(key: str, text: str) -> str:
            ratio = r["x_base"].get(key)
            return f"{text}\n[bold]{ratio:.2f}x[/]" if ratio is not None and r is not rows[0] else text

        split = f"{r['prefill_steps_per_run']:.0f}+{r['decode_steps_per_run']:.0f}"
        t.add_row(str(r["tp"]), f"{r['steps_per_run']:.0f} ({split})",
                  cell("step_ms", fmt(r["step_ms"], " ms", 2)),
                  cell("prefill_step_ms", fmt(r["prefill_step_ms"], " ms", 2)),
                  cell("decode_step_ms", fmt(r["decode_step_ms"], " ms", 2)),
                  fmt(r["all_reduces_per_step"], "", 2), fmt(r["all_reduce_ms"], " ms", 3),
                  f"{r['all_reduce_share']:.0%}", f"{r['gather_share']:.0%}", f"{r['broadcast_share']:.0%}",
                  cell("other_step_ms", fmt(r["other_step_ms"], " ms", 2)),
                  cell("output_tokens_per_s", fmt(r["output_tokens_per_s"], "", 0)),
                  cell("computed_tokens_per_s", fmt(r["computed_tokens_per_s"], "", 0)),
                  "[green]same[/]" if r["parity"] else "[red]FAIL[/]")
    console.print(t)
    console.print(f"  steps/run: all (with a prompt slice + decode only). step, with slice, decode only: mean step "
                  f"time of those steps, rank 0's wall clock, pooled over the timed runs; below a value, its ratio to "
                  f"tp {rows[0]['tp']}'s. AR/step: all-reduces per step; one AR: the mean time of one. AR, gather, "
                  f"bcast: the share of the timed runs' wall time rank 0 spent in all-reduces, in the LM head's gather "
                  f"and in broadcasting each step (waits for the other ranks included). rest: the mean step minus "
                  f"those (rank 0's own compute, scheduling, sampling). out tok/s: output tokens; all tok/s: prompt "
                  f"and output tokens computed, per second of the timed runs")


def show_kv(console: Console, rows: list[dict], measured: dict[int, float], weights: dict[int, int], cfg: Qwen3Config,
            budget_mib: float, block_size: int, dtype: str) -> None:
    t = Table(title=f"KV capacity per rank in {budget_mib:g} MiB ({dtype}, blocks of {block_size} tokens; "
                    f"the model has {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads)")
    for name in ("tp", "query heads/rank", "KV heads/rank", "one block/rank", "blocks/rank", "tokens", "x tp 1",
                 "measured pool", "weights/rank"):
        t.add_column(name, justify="right")
    base = next((r["blocks"] for r in rows if "blocks" in r), None)
    for r in rows:
        if "refused" in r:
            continue  # named below the table
        m = measured.get(r["tp"])
        check = "—" if m is None else (f"[green]{m / 1024:,.0f} KiB/block[/]" if m == r["block_bytes"]
                                        else f"[red]{m / 1024:,.1f} KiB/block[/]")
        w = weights.get(r["tp"])
        t.add_row(str(r["tp"]), str(r["q_heads"]), f"{r['kv_heads']}{' (replicated)' if r['replicated'] else ''}",
                  f"{r['block_bytes'] / 1024:,.0f} KiB", f"{r['blocks']:,}", f"{r['tokens']:,}",
                  f"{r['blocks'] / base:.2f}x" if base else "—", check, "—" if w is None else f"{w / MIB:,.1f} MiB")
    console.print(t)
    console.print("  one block/rank: S x 2 (K, V) x its KV heads x D x layers x dtype bytes, from layout.local_config; "
                  "measured pool: runner.pool.bytes() / pool blocks in the child that ran that tp (green: equal to the "
                  "arithmetic); weights/rank: the child's parameters as loaded")
    for r in rows:
        if "refused" in r:
            console.print(f"  [yellow]tp {r['tp']}: refused ({r['refused']})[/]")


def parse_sizes(text: str, flag: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise CourseError(f"{flag} {text!r}: use comma-separated integers")
    if not sizes or any(s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
        raise CourseError(f"{flag} {text!r}: distinct sizes of at least 1")
    return sizes


def parser() -> OneLineParser:
    p = OneLineParser(prog="l10_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-sizes", default="1,2",
                   help="comma-separated tp sizes to run, the first one the baseline (default 1,2)")
    p.add_argument("--requests", type=int, default=8, help="requests per timed run (default 8)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[192, 384], metavar=("MIN", "MAX"),
                   help="prompt tokens, drawn per request (default 192 384)")
    p.add_argument("--new-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per tp, a fresh engine each (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-mib", type=float, default=64, help="KV budget per rank for the capacity table (default 64)")
    p.add_argument("--kv-tp-sizes", default="1,2,4", help="tp sizes of the capacity table (default 1,2,4)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=DEFAULT_MAX_BATCHED_TOKENS,
                   help=f"L8's token budget per step (default {DEFAULT_MAX_BATCHED_TOKENS})")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING)
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--threads", type=int, help="torch threads per rank (default: torch's choice; OMP_NUM_THREADS=1 "
                   "or 1 gives the most stable numbers)")
    p.add_argument("--tp-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a collective may wait")
    p.add_argument("--child-timeout", type=float, default=600, help="seconds one tp size may take (default 600)")
    p.add_argument("--model", help="HF-format Qwen3 checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # run one tp size, print one JSON line
    return p


def check_args(args) -> None:
    for name in ("requests", "new_tokens", "repeats", "block_size", "max_running"):
        if getattr(args, name) < 1:
            raise CourseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        raise CourseError(f"--prompt-len needs 1 <= MIN <= MAX, got {args.prompt_len[0]} {args.prompt_len[1]}")
    if args.threads is not None and args.threads < 1:
        raise CourseError(f"--threads must be at least 1, got {args.threads}")
    if not args.kv_mib > 0:
        raise CourseError(f"--kv-mib must be above 0, got {args.kv_mib}")


def child_argv(args) -> list[str]:
    """The options a child needs, as given to the parent (so it resolves them the same way)."""
    argv = ["--requests", str(args.requests), "--prompt-len", *map(str, args.prompt_len), "--new-tokens",
            str(args.new_tokens), "--repeats", str(args.repeats), "--seed", str(args.seed), "--block-size",
            str(args.block_size), "--max-batched-tokens", str(args.max_batched_tokens), "--max-running",
            str(args.max_running), "--backend", args.backend, "--tp-timeout", str(args.tp_timeout), "--device",
            args.device]
    for name in ("threads", "model", "dtype"):
        if getattr(args, name) is not None:
            argv += [f"--{name}", str(getattr(args, name))]
    return argv


def main() -> None:
    args = parser().parse_args()
    if args.child is not None:
        try:
            check_args(args)
            child(args)
        except (CourseError, RunFailure) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(1 if isinstance(e, RunFailure) else 2)
        return
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        check_args(args)
        tp_sizes, kv_sizes = parse_sizes(args.tp_sizes, "--tp-sizes"), parse_sizes(args.kv_tp_sizes, "--kv-tp-sizes")
        if args.threads:
            torch.set_num_threads(args.threads)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        model_dir = resolve_model_dir(args.model, default_model_dir)
        cfg = Qwen3Config.from_dir(model_dir)
        for tp in tp_sizes:  # a tp this model cannot split fails here, before any process starts
            check_tp(cfg, tp)
        if cfg.vocab_size <= TOKEN_LO:
            raise CourseError(f"the model's vocabulary ({cfg.vocab_size}) is too small for token ids from {TOKEN_LO}")
        for r in range(args.repeats):
            jobs = make_jobs(args.seed, r, args.requests, tuple(args.prompt_len), args.new_tokens, cfg.vocab_size)
            for ids, new in jobs:
                check_prompt(ids, StopRule(new), cfg)
        dtype_name = str(dtype).removeprefix("torch.")
        conditions = bench_conditions.start()
        threads = torch.get_num_threads()
        lengths = [len(ids) for ids, _ in make_jobs(args.seed, 0, args.requests, tuple(args.prompt_len),
                                                    args.new_tokens, cfg.vocab_size)]
        console.print(f"[bold]L10 tensor-parallel benchmark[/]: {model_dir.name}, {device}, {dtype_name}, torch "
                      f"threads {threads} per rank, {conditions['cores']} cores, seed {args.seed}, {args.repeats} "
                      f"timed run(s) per tp")
        console.print(f"  workload: {args.requests} requests at once, prompts of "
                      f"{args.prompt_len[0]}-{args.prompt_len[1]} "
                      f"random token ids (run 1: {', '.join(map(str, lengths))}), {args.new_tokens} new tokens each, "
                      f"greedy, EOS ignored; token budget {args.max_batched_tokens} per step, blocks of "
                      f"{args.block_size}; "
                      f"{cfg.num_hidden_layers} layers, so {2 * cfg.num_hidden_layers + 1} all-reduces per forward")
        t0 = time.perf_counter()
        results = []
        for tp in tp_sizes:
            t_child = time.perf_counter()
            res = run_child(tp, child_argv(args), args.child_timeout)
            res["child_wall_s"] = time.perf_counter() - t_child
            results.append(res)
            console.print(f"  tp {tp}: {res['child_wall_s']:.1f} s in all (start and load {res['ready_s']:.1f} s), "
                          f"{res['tp']} rank(s) x {res['threads_per_rank']} torch thread(s), timed runs "
                          + ", ".join(f"{run['wall_s']:.2f} s" for run in res["runs"]))
        wall = time.perf_counter() - t0
    except (CourseError, RunFailure) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1 if isinstance(e, RunFailure) else 2)
    bench_conditions.finish(conditions, console)
    busiest = max(r["tp"] * r["threads_per_rank"] for r in results)
    per_tp = ", ".join(f"tp {r['tp']}: {r['tp']} x {r['threads_per_rank']}" for r in results)
    console.print(f"ranks x threads: up to {busiest} busy threads on {conditions['cores']} cores ({per_tp}); "
                  f"load average (1 min) at each child's start: "
                  + ", ".join(f"tp {r['tp']} {r['load1_at_start']:.2f}" for r in results))
    if busiest > conditions["cores"]:
        console.print(f"[yellow]warning: {busiest} threads on {conditions['cores']} cores: the ranks take turns on the "
                      "cores, and every all-reduce waits for the slower one. --threads 1 gives each rank a core.[/]")
    rows = [summarize(r) for r in results]
    base_outputs = results[0]["runs"]
    for row, res in zip(rows, results):
        row["x_base"] = {k: (row[k] / rows[0][k] if row[k] is not None and rows[0][k] else None) for k in RATIO_KEYS}
        row["parity"] = [run["outputs"] for run in res["runs"]] == [run["outputs"] for run in base_outputs] and all(
            len(o) == args.new_tokens for run in res["runs"] for o in run["outputs"])
        row["notes"] = [f"{run['cached_tokens']} prompt tokens from the prefix cache, "
                        f"{run['preemptions']} preemption(s)"
                        for run in res["runs"] if run["cached_tokens"] or run["preemptions"]]
    show_steps(console, rows, f"Per engine step on rank 0: {args.requests} requests, "
                              f"{args.requests * args.new_tokens} output tokens per run")
    budget = int(args.kv_mib * MIB)
    kv = kv_capacity(cfg, kv_sizes, args.block_size, dtype.itemsize, budget)
    measured = {r["tp"]: r["pool_bytes"] / r["pool_blocks"] for r in results}
    weights = {r["tp"]: r["weights_bytes_per_rank"] for r in results}
    show_kv(console, kv, measured, weights, cfg, args.kv_mib, args.block_size, dtype_name)
    for r in rows:
        for note in r["notes"]:
            console.print(f"  [yellow]tp {r['tp']}: {note}[/]")
    report = {"command": " ".join(sys.argv), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPU cores, torch {torch.__version__}", "model": str(model_dir), "device": str(device),
              "dtype": dtype_name, "conditions": conditions, "threads_per_rank": threads, "seed": args.seed,
              "repeats": args.repeats, "wall_seconds": wall,
              "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                           "max_batched_tokens": args.max_batched_tokens, "block_size": args.block_size},
              "tp": rows, "kv_capacity": {"budget_bytes": budget, "rows": kv},
              "children": [{k: v for k, v in r.items() if k != "runs"} | {"runs": [
                  {"wall_s": run["wall_s"], "steps": run["steps"]} for run in r["runs"]]} for r in results]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        console.print(f"results written to {args.json}")
    console.print(f"wall time {wall:.0f} s")
    failed = [r["tp"] for r in rows if not r["parity"]]
    if failed:
        console.print(f"[red]FAIL[/]: greedy tokens differ from tp {rows[0]['tp']}'s at tp "
                      f"{', '.join(map(str, failed))}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()

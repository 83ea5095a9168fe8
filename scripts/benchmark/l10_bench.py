"""Tensor parallelism on this machine: one seeded workload on L10's engine at each --tp-sizes (default 1 and 2),
per engine step on rank 0, and the KV capacity per rank that a split buys in a fixed memory budget.

    OMP_NUM_THREADS=1 python scripts/benchmark/l10_bench.py [--tp-sizes 1,2] [--rounds 1] [--requests 8]
        [--prompt-len 192 384] [--new-tokens 32] [--repeats 3] [--kv-mib 64] [--json PATH] [--png PATH] ...

One torch.distributed group per process, so each tp size runs in a fresh child process of this script (hidden
--child mode, one JSON line), one at a time, --rounds children per tp in harness.alternate's order, their runs
pooled. Ranks 1..tp-1 get rank 0's thread count: tp 2 at one thread per rank fills a 2-core machine, and the
conditions line's `busiest` says so. Workload: --requests random prompts (token ids 1000..min(100000, vocab),
no shared blocks), --new-tokens each, greedy, EOS ignored, all at once, L8's token budget; a fresh engine per
timed run, warmed up untimed. Reported per tp, with ratios to the first: steps, mean and p50/p90 step, the
all-reduces and the shares of the run in each collective (TpGroup.seconds, waits included), the rest of a step,
tokens/s; greedy tokens must equal the first tp's, else FAIL, exit 1. KV capacity is arithmetic from rank 0's
TpLayout, checked against each child's measured pool.

On a 2-core CPU tp 2 is slower than tp 1: the matmuls halve, but every forward adds 2 * layers + 1 gloo
all-reduces over loopback, the step broadcast and the logits gather. It teaches correctness, not speed.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark's own modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's lessons/ and shared/, not an installed course's
import harness  # noqa: E402
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
    load_before = harness.load1()
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
        result = {"tp": tp, "threads_per_rank": torch.get_num_threads(), "backend": harness.backend_name(engine),
                  "load1_at_start": load_before, "ready_s": ready_s, "num_blocks": num_blocks,
                  "pool_bytes": pool.bytes(), "pool_blocks": pool.num_blocks,
                  "weights_bytes_per_rank": sum(weights.values()),
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


def summarize(runs: list[dict], tp: int) -> dict:
    """One tp's timed runs, pooled over its children."""
    steps = [s for run in runs for s in run["steps"]]
    wall = sum(run["wall_s"] for run in runs)
    n = len(steps)
    calls = {c: sum(s["calls"][c] for s in steps) for c in COLLECTIVES}
    secs = {c: sum(s["seconds"][c] for s in steps) for c in COLLECTIVES}
    prefill, decode = ([s["s"] for s in steps if s["prefill"] == kind] for kind in (True, False))
    pct = harness.percentiles([1e3 * s["s"] for s in steps], (50, 90))
    out_tokens = sum(len(o) for run in runs for o in run["outputs"])
    return {"tp": tp, "runs": len(runs), "steps_per_run": n / len(runs), "wall_s_per_run": wall / len(runs),
            "step_ms": 1e3 * wall / n, "step_p50_ms": pct["p50"], "step_p90_ms": pct["p90"],
            **{f"{name}_step_ms": 1e3 * sum(xs) / len(xs) if xs else None for name, xs in (("prefill", prefill),
                                                                                             ("decode", decode))},
            "prefill_steps_per_run": len(prefill) / len(runs), "decode_steps_per_run": len(decode) / len(runs),
            "all_reduces_per_step": calls["all-reduce"] / n,
            "all_reduce_ms": 1e3 * secs["all-reduce"] / calls["all-reduce"] if calls["all-reduce"] else None,
            **{f"{c.replace('-', '_')}_share": secs[c] / wall for c in COLLECTIVES},
            "collective_ms_per_step": {c: 1e3 * secs[c] / n for c in COLLECTIVES},
            "other_step_ms": 1e3 * (wall - sum(secs.values())) / n,
            "output_tokens_per_s": out_tokens / wall, "computed_tokens_per_s": sum(s["tokens"] for s in steps) / wall}


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


def step_cells(r: dict, base: dict) -> list[str]:
    def cell(key: str, text: str) -> str:  # below a value, its ratio to the first tp's
        ratio = r["x_base"].get(key)
        return f"{text}\n[bold]{ratio:.2f}x[/]" if ratio is not None and r is not base else text

    fmt = harness.fmt
    split = f"{r['prefill_steps_per_run']:.0f}+{r['decode_steps_per_run']:.0f}"
    return [str(r["tp"]), f"{r['steps_per_run']:.0f} ({split})", cell("step_ms", fmt(r["step_ms"], " ms", 2)),
            f"{fmt(r['step_p50_ms'], '', 2)} / {fmt(r['step_p90_ms'], ' ms', 2)}",
            cell("prefill_step_ms", fmt(r["prefill_step_ms"], " ms", 2)),
            cell("decode_step_ms", fmt(r["decode_step_ms"], " ms", 2)),
            fmt(r["all_reduces_per_step"], "", 2), fmt(r["all_reduce_ms"], " ms", 3),
            f"{r['all_reduce_share']:.0%}", f"{r['gather_share']:.0%}", f"{r['broadcast_share']:.0%}",
            cell("other_step_ms", fmt(r["other_step_ms"], " ms", 2)),
            cell("output_tokens_per_s", fmt(r["output_tokens_per_s"], "", 0)),
            cell("computed_tokens_per_s", fmt(r["computed_tokens_per_s"], "", 0)),
            "[green]same[/]" if r["parity"] else "[red]FAIL[/]"]


STEP_COLUMNS = ["tp", "steps/run", "step", "p50 / p90", "with slice", "decode only", "AR/step", "one AR", "AR",
                "gather", "bcast", "rest", "out tok/s", "all tok/s", "parity"]


def kv_cells(r: dict, base: int | None, measured: float | None, weights: int | None) -> list[str]:
    check = "-" if measured is None else (f"[green]{measured / 1024:,.0f} KiB/block[/]" if measured == r["block_bytes"]
                                          else f"[red]{measured / 1024:,.1f} KiB/block[/]")
    return [str(r["tp"]), str(r["q_heads"]), f"{r['kv_heads']}{' (replicated)' if r['replicated'] else ''}",
            f"{r['block_bytes'] / 1024:,.0f} KiB", f"{r['blocks']:,}", f"{r['tokens']:,}",
            f"{r['blocks'] / base:.2f}x" if base else "-", check, harness.fmt(weights and weights / MIB, " MiB")]


def plot(rows: list[dict], path: Path, conditions: harness.Conditions, console: Console) -> Path:
    """Rank 0's mean step per tp, stacked: its own work, then what it spent in each collective."""
    fig, ax = harness.figure(figsize=(6, 4.2))
    names = [f"tp {r['tp']}" for r in rows]
    bottom = [0.0] * len(rows)
    parts = [("rest (compute, scheduling, sampling)", [r["other_step_ms"] for r in rows])]
    parts += [(c, [r["collective_ms_per_step"][c] for r in rows]) for c in COLLECTIVES]
    for label, heights in parts:
        ax.bar(names, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("mean engine step on rank 0 (ms)")
    ax.set_title(f"L10 tensor parallelism: where a step's time goes ({conditions.threads} thread(s) per rank)",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return harness.save_png(fig, path, conditions, console)


def sizes(text: str) -> list[int]:
    """--tp-sizes 1,2: distinct sizes of at least 1 (an argparse type, so a bad list is one line, exit 2)."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use comma-separated integers")
    if any(s < 1 for s in out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct sizes of at least 1")
    return out


def parser() -> OneLineParser:
    p = OneLineParser(prog="l10_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-sizes", type=sizes, default="1,2",
                   help="comma-separated tp sizes to run, the first one the baseline (default 1,2)")
    p.add_argument("--requests", type=int, default=8, help="requests per timed run (default 8)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[192, 384], metavar=("MIN", "MAX"),
                   help="prompt tokens, drawn per request (default 192 384)")
    p.add_argument("--new-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per child, a fresh engine each (default 3)")
    p.add_argument("--rounds", type=int, default=1,
                   help="children per tp size, run in alternating order (1, 2, 2, 1, ...) (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-mib", type=float, default=64, help="KV budget per rank for the capacity table (default 64)")
    p.add_argument("--kv-tp-sizes", type=sizes, default="1,2,4", help="tp sizes of the capacity table (default 1,2,4)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=DEFAULT_MAX_BATCHED_TOKENS,
                   help=f"L8's token budget per step (default {DEFAULT_MAX_BATCHED_TOKENS})")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING)
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--threads", type=int, help="torch threads per rank (default: torch's choice; OMP_NUM_THREADS=1 "
                   "or 1 gives the most stable numbers)")
    p.add_argument("--tp-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a collective may wait")
    p.add_argument("--child-timeout", type=float, default=600, help="seconds one child may take (default 600)")
    p.add_argument("--model", help="HF-format Qwen3 checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--png", metavar="PATH", help="also plot each tp's mean step, split by where it went")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # run one tp size, print one JSON line
    return p


def check_args(args) -> None:
    for name in ("requests", "new_tokens", "repeats", "rounds", "block_size", "max_running", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CourseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        raise CourseError(f"--prompt-len needs 1 <= MIN <= MAX, got {args.prompt_len[0]} {args.prompt_len[1]}")
    if not args.kv_mib > 0:
        raise CourseError(f"--kv-mib must be above 0, got {args.kv_mib}")


def main() -> None:
    args = parser().parse_args()
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        check_args(args)
        if args.child is not None:
            return child(args)  # one tp size in this process; the parent reads its one JSON line
        tp_sizes, kv_sizes = args.tp_sizes, args.kv_tp_sizes
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
            for ids, new in make_jobs(args.seed, r, args.requests, tuple(args.prompt_len), args.new_tokens,
                                      cfg.vocab_size):
                check_prompt(ids, StopRule(new), cfg)
        conditions = harness.start(device, dtype, backend=args.backend)
        conditions.extra["model"] = "embedded" if args.model is None else args.model
        lengths = [len(ids) for ids, _ in make_jobs(args.seed, 0, args.requests, tuple(args.prompt_len),
                                                    args.new_tokens, cfg.vocab_size)]
        console.print(f"[bold]L10 tensor-parallel benchmark[/]: {model_dir.name}, seed {args.seed}, {args.rounds} "
                      f"child(ren) per tp of {args.repeats} timed run(s) each")
        console.print(f"  workload: {args.requests} requests at once, prompts of {args.prompt_len[0]}-"
                      f"{args.prompt_len[1]} random token ids (run 1: {', '.join(map(str, lengths))}), "
                      f"{args.new_tokens} new tokens each, greedy, EOS ignored; token budget {args.max_batched_tokens} "
                      f"per step, blocks of {args.block_size}; {cfg.num_hidden_layers} layers, so "
                      f"{2 * cfg.num_hidden_layers + 1} all-reduces per forward")
        t0 = time.perf_counter()
        ran: list[dict] = []  # every child, in the order they ran
        for k, tp in harness.alternate(tp_sizes, args.rounds):
            t_child = time.perf_counter()
            res = run_child(tp, sys.argv[1:], args.child_timeout)  # a child ignores the parent-only options
            res["child_wall_s"] = time.perf_counter() - t_child
            ran.append(res)
            console.print(f"  round {k + 1}/{args.rounds}, tp {tp}: {res['child_wall_s']:.1f} s in all (start and "
                          f"load {res['ready_s']:.1f} s), {tp} rank(s) x {res['threads_per_rank']} torch thread(s), "
                          "timed runs " + ", ".join(f"{run['wall_s']:.2f} s" for run in res["runs"]))
        wall = time.perf_counter() - t0
    except (CourseError, RunFailure) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1 if isinstance(e, RunFailure) else 2)
    conditions.backend = ",".join(sorted({res["backend"] for res in ran}))  # rank 0's engines, every child
    conditions.threads = max(res["threads_per_rank"] for res in ran)
    busiest = max(res["tp"] * res["threads_per_rank"] for res in ran)
    conditions.extra["tp"] = ",".join(map(str, tp_sizes))
    conditions.extra["busiest"] = f"{busiest} threads"  # tp ranks x threads each: what the load after counts
    harness.finish(conditions, console)
    console.print("  load average (1 min) at each child's start: " + ", ".join(
        f"tp {res['tp']} {res['load1_at_start']:.2f}" for res in ran))
    if busiest > conditions.cores:
        console.print(f"[yellow]warning: {busiest} threads on {conditions.cores} cores: the ranks take turns on the "
                      "cores, and every all-reduce waits for the slower one. --threads 1 gives each rank a core.[/]")
    runs_at = {tp: [run for res in ran if res["tp"] == tp for run in res["runs"]] for tp in tp_sizes}  # pooled
    rows = [summarize(runs_at[tp], tp) for tp in tp_sizes]
    base, base_outputs = rows[0], [run["outputs"] for run in runs_at[tp_sizes[0]]]
    for row in rows:
        runs = runs_at[row["tp"]]
        row["x_base"] = {k: (row[k] / base[k] if row[k] is not None and base[k] else None) for k in RATIO_KEYS}
        row["parity"] = [run["outputs"] for run in runs] == base_outputs and all(
            len(o) == args.new_tokens for run in runs for o in run["outputs"])
        row["notes"] = [f"{run['cached_tokens']} prompt tokens from the prefix cache, {run['preemptions']} "
                        "preemption(s)" for run in runs if run["cached_tokens"] or run["preemptions"]]
    console.print(harness.table(f"Per engine step on rank 0: {args.requests} requests, "
                                f"{args.requests * args.new_tokens} output tokens per run",
                                STEP_COLUMNS, [step_cells(r, base) for r in rows]))
    console.print(f"  steps/run: with a prompt slice + decode only. step, with slice, decode only: mean of those "
                  f"steps (below: ratio to tp {base['tp']}'s); p50 / p90 of all steps. AR, gather, bcast: shares of "
                  "the timed wall time in each collective, waits included; rest: the step without them. all tok/s: "
                  "prompt + output")
    budget = int(args.kv_mib * MIB)
    dtype_name = str(dtype).removeprefix("torch.")
    kv = kv_capacity(cfg, kv_sizes, args.block_size, dtype.itemsize, budget)
    measured = {res["tp"]: res["pool_bytes"] / res["pool_blocks"] for res in ran}
    weights = {res["tp"]: res["weights_bytes_per_rank"] for res in ran}
    kv_base = next((r["blocks"] for r in kv if "blocks" in r), None)
    console.print(harness.table(
        f"KV capacity per rank in {args.kv_mib:g} MiB ({dtype_name}, blocks of {args.block_size} tokens; the model "
        f"has {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads)",
        ["tp", "query heads/rank", "KV heads/rank", "one block/rank", "blocks/rank", "tokens", "x tp 1",
         "measured pool", "weights/rank"],
        [kv_cells(r, kv_base, measured.get(r["tp"]), weights.get(r["tp"])) for r in kv if "refused" not in r]))
    console.print("  one block/rank: S x 2 (K, V) x KV heads x D x layers x dtype bytes (layout.local_config); "
                  "measured pool: runner.pool.bytes() / blocks in that tp's child (green: equal); weights/rank: as "
                  "loaded")
    for r in kv:
        if "refused" in r:
            console.print(f"  [yellow]tp {r['tp']}: refused ({r['refused']})[/]")
    for r in rows:
        for note in r["notes"]:
            console.print(f"  [yellow]tp {r['tp']}: {note}[/]")
    report = {"model": str(model_dir), "seed": args.seed, "repeats": args.repeats, "rounds": args.rounds,
              "wall_seconds": wall, "workload": {"requests": args.requests, "prompt_len": args.prompt_len,
                                                 "new_tokens": args.new_tokens, "block_size": args.block_size,
                                                 "max_batched_tokens": args.max_batched_tokens},
              "tp": rows, "kv_capacity": {"budget_bytes": budget, "rows": kv},
              "children": [{k: v for k, v in res.items() if k != "runs"} | {"runs": [
                  {"wall_s": run["wall_s"], "steps": run["steps"]} for run in res["runs"]]} for res in ran]}
    if args.png:
        report["png"] = str(plot(rows, Path(args.png), conditions, console))
    if args.json:
        harness.write_json(args.json, report, conditions, console)
    console.print(f"wall time {wall:.0f} s")
    failed = [r["tp"] for r in rows if not r["parity"]]
    if failed:
        console.print(f"[red]FAIL[/]: greedy tokens differ from tp {base['tp']}'s at tp {', '.join(map(str, failed))}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()

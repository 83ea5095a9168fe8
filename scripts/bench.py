"""Benchmark: one mixed workload through HF generate (alone, padded static batches), HF's own continuous
batching, and the course's L3, L4 and L5 engines; then, for a fixed KV budget, how many requests run at
once with max-length reservation versus paged blocks. Prints rich tables and writes a JSON file.

Throughput is output tokens a request asked for, per second, as a ratio to the best HF baseline of the
same invocation (never a bare number across machines), and as a share of this machine's own matmul
roofline, measured in the same run (scripts/benchmark/roofline.py). `--threads 1` on an idle machine gives the most
stable numbers; the run records its thread count and load average and warns when others shared the CPU.
`--plot DIR` also draws PNGs (needs matplotlib). Not a test: tests never time anything.
"""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmark"))  # the benchmark's own modules
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
import bench_systems as bs  # noqa: E402
import harness  # noqa: E402
from bench_systems import bench_shape_dir  # noqa: E402
from kv_budget import budget_rows  # noqa: E402
from roofline import Rates, WorkLog, flops, roofline_by_op  # noqa: E402
from work_log import recording  # noqa: E402
from shared.cli import OneLineParser, resolve_device, resolve_dtype, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

SYSTEMS = ("hf-single", "hf-static", "hf-cb", "l3", "l4", "l5", "l6")
WORKLOADS = ("mixed", "shared-prefix")
def parser() -> OneLineParser:
    p = OneLineParser(prog="bench.py", description=__doc__)
    p.add_argument("--model", action="append", help="'tiny', 'bench' (a larger built-in shape), 'smollm2' (a "
                   "trained Llama) or an HF Qwen3 or Llama directory; repeatable (default: tiny and bench)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=WORKLOADS, default="mixed",
                   help="mixed: random prompts of --prompt-len; shared-prefix: one --prefix-len-token system "
                        "prompt, then --unique-len tokens per request (L6's case)")
    p.add_argument("--prefix-len", type=int, default=900, help="shared-prefix: tokens every prompt starts with")
    p.add_argument("--unique-len", type=int, nargs=2, default=(80, 120), metavar=("MIN", "MAX"),
                   help="shared-prefix: each prompt's own tokens after the shared ones")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)}; 'none' prints only the KV-budget table")
    p.add_argument("--single-requests", type=int, default=16,
                   help="HF one-at-a-time runs only the first N requests (its tokens/s is a rate; it is the slowest)")
    p.add_argument("--static-batch", type=int, default=8, help="batch size of HF's padded batches and L3")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=8192, help="L4/L5 pool size in tokens")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--kv-budget", type=int, help="KV budget in tokens for the concurrency table (default: --kv-tokens; 0 skips it)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 for every system, HF included (default: float32 "
                   "on cpu, bfloat16 on cuda); the roofline is measured in the same dtype")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); 1 gives the most "
                   "stable numbers on a shared machine")
    p.add_argument("--out", default="bench_results.json", help="JSON results file")
    p.add_argument("--plot", metavar="DIR", help="also write PNG charts into DIR (needs matplotlib)")
    return p


def check(args) -> None:
    for name in ("requests", "single_requests", "static_batch", "block_size", "kv_tokens", "max_running"):
        if getattr(args, name) < 1:
            raise CourseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name, (lo, hi) in (("prompt-len", args.prompt_len), ("new-tokens", args.new_tokens), ("unique-len", args.unique_len)):
        if not 1 <= lo <= hi:
            raise CourseError(f"--{name} needs 1 <= MIN <= MAX, got {lo} {hi}")
    unknown = set(args.systems.split(",")) - set(SYSTEMS) - {"none"}
    if unknown:
        raise CourseError(f"unknown system(s) {sorted(unknown)}: use {','.join(SYSTEMS)}")
    if args.prefix_len < 0:
        raise CourseError(f"--prefix-len must be >= 0, got {args.prefix_len}")
    longest = (args.prompt_len[1] if args.workload == "mixed" else args.prefix_len + args.unique_len[1]) + args.new_tokens[1]
    if longest > args.kv_tokens:
        raise CourseError(f"the longest request ({longest} tokens) exceeds --kv-tokens {args.kv_tokens}")
    if args.threads is not None and args.threads < 1:
        raise CourseError(f"--threads must be at least 1, got {args.threads}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # fail before the long run, not after it
        raise CourseError("--plot needs matplotlib: pip install matplotlib")


def model_dir(name: str) -> Path:
    if name == "tiny":
        return default_model_dir()
    if name == "bench":
        return bench_shape_dir()
    if name == "smollm2":  # converted into the cache on first use; a one-line error if its package is missing
        return resolve_model_dir(name, default_model_dir)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise CourseError(f"--model {name}: not 'tiny', 'bench', 'smollm2' or a checkpoint directory")
    return path


def run_model(name: str, args, device, dtype, console: Console) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    path = model_dir(name)
    ours = Qwen3ForCausalLM.from_dir(path, dtype, device)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    if args.workload == "mixed":
        jobs = bs.make_workload(args.requests, tuple(args.prompt_len), tuple(args.new_tokens), ours.config.vocab_size, args.seed)
    else:
        jobs = bs.make_shared_prefix_workload(args.requests, args.prefix_len, tuple(args.unique_len), tuple(args.new_tokens),
                                              ours.config.vocab_size, args.seed)
    blocks = -(-args.kv_tokens // args.block_size)
    timeline = bool(args.plot)  # the pool pictures need who held what at every step; tables do not
    runs = {
        # The slowest baseline by far: its rate is measured on the first --single-requests requests only.
        "hf-single": lambda p: bs.hf_single(hf, jobs[: args.single_requests], p),
        "hf-static": lambda p: bs.hf_static(hf, jobs, args.static_batch, p),
        "hf-cb": lambda p: bs.hf_continuous(hf, jobs, args.block_size, blocks, args.max_running, p),
        "l3": lambda p: bs.l3_static(ours, jobs, args.static_batch, args.block_size, args.backend, p),
        "l4": lambda p: bs.l4(ours, jobs, args.block_size, blocks, args.max_running, args.backend, p, timeline=timeline),
        "l5": lambda p: bs.l5(ours, jobs, args.block_size, blocks, args.max_running, args.backend, p, timeline=timeline),
        "l6": lambda p: bs.l6(ours, jobs, args.block_size, blocks, args.max_running, args.backend, p),
    }
    results, logs = [], []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress, torch.inference_mode():
        for key in args.systems.split(","):
            task = progress.add_task(f"{name}: {key}", total=min(len(jobs), args.single_requests) if key == "hf-single" else len(jobs))
            with recording(ours, hf) as log:
                results.append(runs[key](lambda n, t=task: progress.advance(t, n)))
            logs.append(log)
    t0 = time.perf_counter()
    rows, rates = ceiling(ours.config, results, logs, dtype, device)
    roof = {"shapes_timed": len(rates.cache), "seconds": time.perf_counter() - t0,
            "best_flops_per_s": max(rates.cache.values(), default=0.0)}
    show(console, f"{name}, {args.workload} workload", path, jobs, results, rows)
    console.print(f"  roofline: {roof['shapes_timed']} matmul shapes timed in {roof['seconds']:.1f} s, in "
                  f"{str(dtype).removeprefix('torch.')} on {torch.get_num_threads()} thread(s); the fastest ran at "
                  f"{roof['best_flops_per_s'] / 1e9:.1f} GFLOP/s")
    return {"model": name, "path": str(path), "jobs": len(jobs), "roofline": roof,
            "results": [vars(r) | {"tokens_per_s": r.tokens_per_s} | row for r, row in zip(results, rows)]}


def ceiling(cfg, results: list[bs.Result], logs: list[WorkLog], dtype, device) -> tuple[list[dict], Rates]:
    """Each system's ratio to the best HF baseline and its share of the roofline, timed after every system ran
    (the same threads, dtype and machine state as the runs), each shape once for all of them."""
    hf_best = max((r.tokens_per_s for r in results if r.system.startswith("HF")), default=0.0)
    rates, rows = Rates(cfg, dtype, device), []
    for r, log in zip(results, logs):
        by_op = roofline_by_op(cfg, log, rates) if not r.error else {}
        roof = sum(by_op.values())
        rows.append({"x_best_hf": r.tokens_per_s / hf_best if hf_best and not r.error else None,
                     "roofline_seconds": roof, "roofline_seconds_by_op": by_op,
                     "roofline_share": roof / r.seconds if r.seconds and not r.error else None,
                     "flops": flops(cfg, log), "tokens_fed": log.tokens_fed, "vocab_rows": log.rows_sampled})
    return rows, rates


def show(console: Console, name: str, path: Path, jobs, results: list[bs.Result], rows: list[dict]) -> None:
    columns = ("system", "seconds", "out tok/s", "x best HF", "roofline share", "KV util mean", "KV util peak",
               "peak running", "preemptions", "prefill tok", "from cache")
    fmt = lambda v, f="{:.1%}": "—" if v is None else f.format(v)  # noqa: E731
    cells = []
    for r, row in zip(results, rows):
        if r.error:
            cells.append([r.system, "[red]failed[/]", r.error[:60], *[""] * 8])
            continue
        cells.append([r.system, f"{r.seconds:.1f}", f"{r.tokens_per_s:.1f}", fmt(row["x_best_hf"], "{:.2f}x"),
                      fmt(row["roofline_share"]), fmt(r.util_mean), fmt(r.util_peak), fmt(r.peak_running, "{}"),
                      fmt(r.preemptions, "{}"), fmt(r.prefill_tokens, "{}"), fmt(r.cached_tokens, "{}")])
    console.print(harness.table(f"{name} ({path.name}): {len(jobs)} requests, "
                                f"{sum(j.new_tokens for j in jobs)} output tokens", columns, cells))
    by = {r.system.split()[0]: r for r in results if not r.error}
    if "L5" in by and "L6" in by and by["L5"].prefill_tokens and by["L5"].tokens_per_s:
        l5, l6 = by["L5"], by["L6"]
        console.print(f"  L6 / L5: prefill tokens computed {l6.prefill_tokens / l5.prefill_tokens:.3f}, "
                      f"throughput {l6.tokens_per_s / l5.tokens_per_s:.2f}x")
    for r in results:
        for note in r.notes:
            console.print(f"  {r.system}: {note}")


def main() -> None:
    args = parser().parse_args()
    console = Console(width=None if sys.stdout.isatty() else 190)  # wide tables in logs and pipes too
    try:
        check(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        here = Path(__file__).resolve().parent / "benchmark"  # the benchmark's own modules the numbers depend on
        conditions = harness.start(device, dtype, code=[str(here / f"{m}.py") for m in
                                                        ("bench_systems", "kv_budget", "roofline", "work_log")])
        t0 = time.perf_counter()
        report = {"models": []}
        for name in [] if args.systems == "none" else args.model or ["tiny", "bench"]:
            report["models"].append(run_model(name, args, device, dtype, console))
        # The backend the course's engines really used (HF's systems have none of ours).
        used = sorted({r["backend"] for m in report["models"] for r in m["results"] if r.get("backend")})
        conditions.backend = ",".join(used) or "none"
        conditions.extra["workload"] = args.workload
        budget = args.kv_tokens if args.kv_budget is None else args.kv_budget
        if budget and args.workload == "mixed":  # the concurrency table is about the mixed workload
            report["kv_budget"] = budget_rows(console, budget, args)
        report["wall_seconds"] = time.perf_counter() - t0
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    console.print(f"wall time {report['wall_seconds']:.0f} s")
    harness.finish(conditions, console)
    harness.write_json(args.out, report, conditions, console)
    if args.plot:
        from bench_plots import draw_all  # matplotlib only when asked for

        for png in draw_all(report, args.plot, -(-args.kv_tokens // args.block_size), conditions):
            console.print(f"plot written to {png}")


if __name__ == "__main__":
    main()

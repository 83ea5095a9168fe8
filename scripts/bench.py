"""Benchmark: one mixed workload through HF generate (alone, padded static batches), HF's own continuous
batching, and the course's L3, L4 and L5 engines; then, for a fixed KV budget, how many requests run at
once with max-length reservation versus paged blocks. Prints rich tables and writes a JSON file.

Throughput is output tokens a request asked for, per second, as a ratio to the best HF baseline of the
same invocation (never a bare number across machines). Not a test: tests never time anything.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_systems as bs  # noqa: E402
from kv_budget import budget_rows  # noqa: E402
from shared.cli import OneLineParser, resolve_device, resolve_dtype  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import cache_root, default_model_dir  # noqa: E402

SYSTEMS = ("hf-single", "hf-static", "hf-cb", "l3", "l4", "l5")
# A shape where the matmuls, not Python and the vocab projection, dominate a step (random weights).
BENCH_SHAPE = dict(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                   rope_theta=1e6, tie_word_embeddings=True)


def bench_shape_dir() -> Path:
    """Built once by transformers itself (its own seeded init) into the course cache."""
    out = cache_root() / "bench-shape-v1"
    if not (out / "config.json").is_file():
        from transformers import Qwen3Config, Qwen3ForCausalLM as HfQwen3

        torch.manual_seed(0)
        HfQwen3(Qwen3Config(**BENCH_SHAPE)).save_pretrained(str(out))
    return out


def parser() -> OneLineParser:
    p = OneLineParser(prog="bench.py", description=__doc__)
    p.add_argument("--model", action="append", help="'tiny', 'bench' (a larger built-in shape) or an HF Qwen3 "
                   "directory; repeatable (default: tiny and bench)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)}; 'none' prints only the KV-budget table")
    p.add_argument("--single-requests", type=int, default=16,
                   help="HF one-at-a-time runs only the first N requests (its tokens/s is a rate; it is the slowest)")
    p.add_argument("--static-batch", type=int, default=8, help="batch size of HF's padded batches and L3")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=8192, help="L4/L5 pool size in tokens")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--kv-budget", type=int, help="KV budget in tokens for the concurrency table (default: --kv-tokens)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default="bench_results.json", help="JSON results file")
    return p


def check(args) -> None:
    for name in ("requests", "single_requests", "static_batch", "block_size", "kv_tokens", "max_running"):
        if getattr(args, name) < 1:
            raise CourseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name, (lo, hi) in (("prompt-len", args.prompt_len), ("new-tokens", args.new_tokens)):
        if not 1 <= lo <= hi:
            raise CourseError(f"--{name} needs 1 <= MIN <= MAX, got {lo} {hi}")
    unknown = set(args.systems.split(",")) - set(SYSTEMS) - {"none"}
    if unknown:
        raise CourseError(f"unknown system(s) {sorted(unknown)}: use {','.join(SYSTEMS)}")
    if args.prompt_len[1] + args.new_tokens[1] > args.kv_tokens:
        raise CourseError(f"the longest request ({args.prompt_len[1] + args.new_tokens[1]} tokens) exceeds --kv-tokens {args.kv_tokens}")


def model_dir(name: str) -> Path:
    if name == "tiny":
        return default_model_dir()
    if name == "bench":
        return bench_shape_dir()
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise CourseError(f"--model {name}: not 'tiny', 'bench' or a checkpoint directory")
    return path


def run_model(name: str, args, device, dtype, console: Console) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    path = model_dir(name)
    ours = Qwen3ForCausalLM.from_dir(path, dtype, device)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    jobs = bs.make_workload(args.requests, tuple(args.prompt_len), tuple(args.new_tokens), ours.config.vocab_size, args.seed)
    blocks = -(-args.kv_tokens // args.block_size)
    runs = {
        # The slowest baseline by far: its rate is measured on the first --single-requests requests only.
        "hf-single": lambda p: bs.hf_single(hf, jobs[: args.single_requests], p),
        "hf-static": lambda p: bs.hf_static(hf, jobs, args.static_batch, p),
        "hf-cb": lambda p: bs.hf_continuous(hf, jobs, args.block_size, blocks, args.max_running, p),
        "l3": lambda p: bs.l3_static(ours, jobs, args.static_batch, args.block_size, args.backend, p),
        "l4": lambda p: bs.l4(ours, jobs, args.block_size, blocks, args.max_running, args.backend, p),
        "l5": lambda p: bs.l5(ours, jobs, args.block_size, blocks, args.max_running, args.backend, p),
    }
    results = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress, torch.inference_mode():
        for key in args.systems.split(","):
            task = progress.add_task(f"{name}: {key}", total=min(len(jobs), args.single_requests) if key == "hf-single" else len(jobs))
            results.append(runs[key](lambda n, t=task: progress.advance(t, n)))
    show(console, name, path, jobs, results)
    return {"model": name, "path": str(path), "jobs": len(jobs), "results": [vars(r) | {"tokens_per_s": r.tokens_per_s}
                                                                              for r in results]}


def show(console: Console, name: str, path: Path, jobs, results) -> None:
    hf_best = max((r.tokens_per_s for r in results if r.system.startswith("HF")), default=0.0)
    t = Table(title=f"{name} ({path.name}): {len(jobs)} requests, {sum(j.new_tokens for j in jobs)} output tokens")
    for col in ("system", "seconds", "out tok/s", "x best HF", "KV util mean", "KV util peak", "peak running", "preemptions"):
        t.add_column(col, justify="left" if col == "system" else "right")
    fmt = lambda v, f="{:.1%}": "—" if v is None else f.format(v)  # noqa: E731
    for r in results:
        if r.error:
            t.add_row(r.system, "[red]failed[/]", r.error[:60], "", "", "", "", "")
            continue
        ratio = f"{r.tokens_per_s / hf_best:.2f}x" if hf_best else "—"
        t.add_row(r.system, f"{r.seconds:.1f}", f"{r.tokens_per_s:.1f}", ratio, fmt(r.util_mean), fmt(r.util_peak),
                  fmt(r.peak_running, "{}"), fmt(r.preemptions, "{}"))
    console.print(t)
    for r in results:
        for note in r.notes:
            console.print(f"  {r.system}: {note}")


def main() -> None:
    args = parser().parse_args()
    console = Console(width=None if sys.stdout.isatty() else 150)  # wide tables in logs and pipes too
    try:
        check(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        t0 = time.perf_counter()
        report = {"command": " ".join(sys.argv), "machine": machine(device), "models": []}
        for name in [] if args.systems == "none" else args.model or ["tiny", "bench"]:
            report["models"].append(run_model(name, args, device, dtype, console))
        budget = args.kv_budget or args.kv_tokens
        report["kv_budget"] = budget_rows(console, budget, args)
        report["wall_seconds"] = time.perf_counter() - t0
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    Path(args.out).write_text(json.dumps(report, indent=2))
    console.print(f"wall time {report['wall_seconds']:.0f} s; results written to {args.out}")


def machine(device) -> str:
    gpu = f", {torch.cuda.get_device_name()}" if device.type == "cuda" else ", no GPU"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores{gpu}, torch {torch.__version__}"


if __name__ == "__main__":
    main()

"""Speculative decoding's wall, measured: what one target forward costs when every request feeds q tokens.

    OMP_NUM_THREADS=1 python scripts/benchmark/l11_bench.py curve [--models tiny,bench] [--batches 1,4,16]
        [--queries 1,2,4,8,16] [--history 512] [--rounds 20] [--json PATH] [--png PATH]

`curve`: one forward of L8's ChunkedRunner (the engine's own runner, pool and attention backend) over a batch
of decode slices, each feeding q query tokens after a history already in the pool. That is exactly what a
verify step with K = q - 1 drafts runs: a decode slice feeds its last committed token plus its drafts,
aligned bottom-right, and gets a logits row for every token it feeds (the LM head runs on all q rows).
q = 1 is a plain decode step, run on the same eager path (no captured graph), so every cell does the same
host work. The history's K/V is whatever the pool holds (zeros): attention reads it the
same whatever it holds, and prefilling 16 x 512 tokens would cost more than the forwards measured. Each
forward rewrites the same q slots, as a verify step whose drafts were all rejected would.

Per model (the embedded tiny model and the bench shape of bench_systems.py, fp32): a pool holding every
request of the largest batch, then --warmup untimed rounds and --rounds timed rounds; a round runs every
(batch, q) cell once, in harness.alternate's order. Reported per cell: the median forward time, its ratio to
q = 1 at the same batch (the price of checking q - 1 drafts), and tokens fed per ms. A ratio under
--free (1.3) is where verification is nearly free: K drafts cost about what one decode does. Timed with
perf_counter around runner.forward only (building the slices is host work the engine does either way).

Then (unless --no-matmul) each model's LM head alone, [vocab, hidden] times M rows for M in --queries: the
largest matmul of a verify step, to show what the CPU's matmul kernel does with a few rows (it need not
cost the same at M = 2 as at M = 1: a weight-bound kernel would, one that reads the weights once per row
would not).

A second subcommand (`speedup`, the engine against itself without speculation) fits beside `curve`.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark's own modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import harness  # noqa: E402
from bench_systems import bench_shape_dir  # noqa: E402
from lessons.l2_token_flat.engine import blocks_for  # noqa: E402
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.sequence import Sequence  # noqa: E402
from lessons.l8_chunked_prefill.runner import ChunkedRunner  # noqa: E402
from lessons.l8_chunked_prefill.slice import Slice  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

MODELS = {"tiny": default_model_dir, "bench": bench_shape_dir}
BLOCK_SIZE = 16


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"integers of at least 1, got {text!r}")
    return sorted(set(values))


def names(text: str) -> list[str]:
    chosen = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in chosen if v not in MODELS]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"models are {', '.join(MODELS)}, got {text!r}")
    return chosen


def requests(model: Qwen3ForCausalLM, runner: ChunkedRunner, batch: int, history: int, q_max: int,
             seed: int) -> list[list[Sequence]]:
    """Per q in 1..q_max, `batch` requests with `history` tokens in the pool and q tokens to feed. The
    requests at every q share one block table per request (each forward rewrites the same slots)."""
    rng = random.Random(seed)
    top = min(model.config.vocab_size, 151643)  # ordinary tokens only
    ids = [[rng.randrange(top) for _ in range(history + q_max)] for _ in range(batch)]
    tables = [runner.allocator.alloc(blocks_for(history + q_max, BLOCK_SIZE)) for _ in range(batch)]
    return [[Sequence(ids[i][:history + q], BLOCK_SIZE, blocks=tables[i], num_cached=history, seq_id=i)
             for i in range(batch)] for q in range(1, q_max + 1)]


def forward_s(runner: ChunkedRunner, seqs: list[Sequence], q: int) -> float:
    """One verify-shaped forward: every request a decode slice of q tokens, q logits rows each."""
    slices = [Slice.of(seq, q, decode=True) for seq in seqs]
    t0 = time.perf_counter()
    logits = runner.forward(slices)
    seconds = time.perf_counter() - t0
    if logits.shape[0] != len(seqs) * q:  # the runner must score every fed row, as a verify step does
        raise RuntimeError(f"{logits.shape[0]} logits rows for {len(seqs)} slices of {q} tokens")
    return seconds


def measure(name: str, args) -> tuple[list[dict], str]:
    """Every (batch, q) cell of one model: median ms over the timed rounds. (rows, backend used)"""
    model = Qwen3ForCausalLM.from_dir(MODELS[name](), torch.float32, torch.device("cpu"))
    q_max, per_request = max(args.queries), blocks_for(args.history + max(args.queries), BLOCK_SIZE)
    runner = ChunkedRunner(model, BLOCK_SIZE, sum(args.batches) * per_request, args.backend)
    built = {b: requests(model, runner, b, args.history, q_max, args.seed) for b in args.batches}
    cells = [(b, q) for b in args.batches for q in args.queries]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
    with torch.inference_mode():
        for r, (b, q) in harness.alternate(cells, args.warmup + args.rounds):
            seconds = forward_s(runner, built[b][q - 1], q)
            if r >= args.warmup:
                times[(b, q)].append(seconds)
    rows = []
    for b, q in cells:
        ms = 1e3 * harness.percentiles(times[(b, q)], (50,))["p50"]
        base = 1e3 * harness.percentiles(times[(b, min(args.queries))], (50,))["p50"]
        rows.append({"model": name, "batch": b, "q": q, "drafts": q - 1, "tokens": b * q, "ms": ms,
                     "ms_all": [1e3 * t for t in times[(b, q)]], "x_q1": ms / base, "tokens_per_ms": b * q / ms,
                     "free": q > min(args.queries) and ms / base < args.free})
    return rows, harness.backend_name(runner)


def verdicts(rows: list[dict], free: float) -> list[str]:
    """Per (model, batch): the q that stay under the free ratio and the q that do not, each with its ratio
    (not "up to q": a CPU's matmul kernels need not grow monotonically in rows, see the matmul table)."""
    out = []
    for name, b in dict.fromkeys((r["model"], r["batch"]) for r in rows):
        cells = [r for r in rows if r["model"] == name and r["batch"] == b]
        say = lambda picked: ", ".join(f"{r['q']} ({r['x_q1']:.2f}x)" for r in picked) or "none"  # noqa: E731
        kept, past = [r for r in cells if r["free"]], [r for r in cells[1:] if not r["free"]]
        out.append(f"{name}, batch {b} (q = {cells[0]['q']}: {cells[0]['ms']:.2f} ms): nearly free (< {free:g}x) at "
                   f"q = {say(kept)}; not at q = {say(past)}")
    return out


def matmul_rows(name: str, rows_asked: list[int], args) -> list[dict]:
    """The model's largest matmul alone (the LM head, [vocab, hidden]) at M rows: one request's verify step
    of q tokens multiplies q rows by it. Median of --rounds, alternating M."""
    model = Qwen3ForCausalLM.from_dir(MODELS[name](), torch.float32, torch.device("cpu"))
    weight = model.lm_head.weight
    xs = {m: torch.randn(m, weight.shape[1]) for m in rows_asked}
    times: dict[int, list[float]] = {m: [] for m in rows_asked}
    with torch.inference_mode():
        for r, m in harness.alternate(rows_asked, args.warmup + args.rounds):
            t0 = time.perf_counter()
            torch.nn.functional.linear(xs[m], weight)
            if r >= args.warmup:
                times[m].append(time.perf_counter() - t0)
    ms = {m: 1e3 * harness.percentiles(times[m], (50,))["p50"] for m in rows_asked}
    return [{"model": name, "shape": list(weight.shape), "rows": m, "ms": ms[m], "x_m1": ms[m] / ms[rows_asked[0]]}
            for m in rows_asked]


def plot(rows: list[dict], path: str, conditions: harness.Conditions, console: Console) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = harness.figure(1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False)
    for ax, name in zip(axes[0], models):
        for b in dict.fromkeys(r["batch"] for r in rows if r["model"] == name):
            cells = [r for r in rows if r["model"] == name and r["batch"] == b]
            ax.plot([r["q"] for r in cells], [r["ms"] for r in cells], "-o", label=f"batch {b}")
        ax.set_xscale("log", base=2)
        qs = sorted({r["q"] for r in rows})
        ax.set_xticks(qs, [str(q) for q in qs], minor=False)
        ax.minorticks_off()
        ax.set_xlabel("query tokens per request q (K = q - 1 drafts)")
        ax.set_ylabel("one forward (ms, median)")
        ax.set_title(f"{name}: one target forward, history {rows[0]['history']} tokens", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    harness.save_png(fig, path, conditions, console)


def curve(args) -> None:
    torch.set_num_threads(args.threads)
    console = Console(width=120)
    conditions = harness.start("cpu", torch.float32, threads=args.threads)
    rows, used = [], set()
    for name in args.models:
        got, backend = measure(name, args)
        rows += [{**r, "history": args.history} for r in got]
        used.add(backend)
    conditions.backend = ",".join(sorted(used))
    conditions.extra.update(history=str(args.history), rounds=str(args.rounds))
    table = [[r["model"], str(r["batch"]), f"{r['q']} (K={r['drafts']})", str(r["tokens"]), f"{r['ms']:.2f}",
              f"{r['x_q1']:.2f}x", f"{r['tokens_per_ms']:.2f}", "nearly free" if r["free"] else ""] for r in rows]
    console.print(harness.table(
        f"one target forward, every request feeding q tokens after {args.history} in the pool (median of "
        f"{args.rounds} rounds after {args.warmup}, block size {BLOCK_SIZE})",
        ("model", "batch", "q", "tokens", "ms", "x q=1", "tokens/ms", f"< {args.free:g}x"), table))
    for line in verdicts(rows, args.free):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    mm = [r for name in args.models for r in matmul_rows(name, args.queries, args)] if args.matmul else []
    if mm:
        console.print(harness.table(
            f"the LM head alone: torch.nn.functional.linear of M rows by its vocab x hidden weight (median of "
            f"{args.rounds} rounds)", ("model", "weight", "M rows", "ms", "x M=1"),
            [[r["model"], " x ".join(map(str, r["shape"])), str(r["rows"]), f"{r['ms']:.2f}", f"{r['x_m1']:.2f}x"]
             for r in mm]))
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"rows": rows, "free": args.free, "lm_head": mm}, conditions, console)
    if args.png:
        plot(rows, args.png, conditions, console)


def parser() -> OneLineParser:
    p = OneLineParser(prog="l11_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("curve", help="one forward's time against query tokens per request")
    c.add_argument("--models", type=names, default="tiny,bench", help=f"of {', '.join(MODELS)} (default both)")
    c.add_argument("--batches", type=ints, default="1,4,16")
    c.add_argument("--queries", type=ints, default="1,2,4,8,16", help="query tokens per request (K + 1)")
    c.add_argument("--history", type=int, default=512, help="tokens per request already in the pool")
    c.add_argument("--rounds", type=int, default=20, help="timed rounds (default 20)")
    c.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    c.add_argument("--free", type=float, default=1.3, help="ratio to q = 1 counted as nearly free")
    c.add_argument("--no-matmul", dest="matmul", action="store_false",
                   help="skip the LM head's matmul timed alone at M = each q rows")
    c.add_argument("--backend", default="auto", choices=BACKENDS)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", metavar="PATH")
    c.add_argument("--png", metavar="PATH")
    c.set_defaults(run=curve)
    return p


def main() -> None:
    args = parser().parse_args()
    try:
        if args.history < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1:
            raise CourseError("--history, --rounds and --threads must be at least 1, --warmup at least 0")
        args.run(args)
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

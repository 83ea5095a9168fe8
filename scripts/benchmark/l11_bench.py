"""Speculative decoding's wall, measured: what one target forward costs when every request feeds q tokens.

    OMP_NUM_THREADS=1 python scripts/benchmark/l11_bench.py curve [--models tiny,bench] [--batches 1,4,16]
        [--queries 1,2,4,8,16] [--history 512] [--rounds 20] [--json PATH] [--png PATH]
    OMP_NUM_THREADS=1 python scripts/benchmark/l11_bench.py speedup [--model bench|tiny|smollm2] [--batches 1,4,16]
        [--alphas 0,0.5,0.8,1] [--k 4] [--prompt-len 32-64] [--max-new-tokens 64] [--rounds 8] [--no-ngram]
        [--json PATH] [--png PATH]

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
would not), and the same product computed as W @ x.T, the weight as the left operand (the kernel chosen
for a few rows, not the arithmetic, can set the price).

`speedup`: L11's engine with a drafter against the same engine without one (drafter=None, exactly L9's), in
one process, fp32, one thread, graphs on as the engine's default (plain decode steps take L7's static-buffer
path; a step with any verify slice runs eagerly). Per batch B (1, 4, 16): B distinct prompts of --prompt-len
tokens, each "<instruction> <random passage> <instruction: repeat it>", all arriving at once, --max-new-tokens
each with EOS ignored, a fresh engine per run whose budget prefills the batch in one step and holds
B x (K + 1) decode tokens. Only decode steps are timed (every request already has its first token), so the
ratio is decode throughput's. An untimed reference run without drafts gives each prompt's greedy output; then
--rounds rounds. A round builds a fresh engine per system -- no drafter, the replay drafter at each --alphas
rate (it proposes the reference output, each draft wrong with probability 1 - alpha, seeded per round), and
the n-gram drafter -- and runs them a step at a time in turns, in harness.alternate's order, so a box that
gets busier mid-round slows every system alike. Every run's outputs must equal the reference, else the benchmark
stops (exit status 1). Reported per (batch, drafter): the speed-up (the plain run's decode time over this
one's in the same round; median and range), tokens per target forward and per decode row, the measured
acceptance beside what the rate predicts, mean accepted length beside (1 - a^(K+1)) / (1 - a), the step's
cost in plain decode steps; per batch the break-even acceptance (interpolated where the speed-up crosses 1,
and where the formula meets the measured verify cost); and whether the target holds: at acceptance 0.8 and
K = 4, at least 2x the plain engine's decode throughput at batch 1 on the bench shape, one thread.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path
from typing import Callable

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
from lessons.l11_speculative import L11Engine  # noqa: E402
from lessons.l11_speculative.ngram import NgramDrafter  # noqa: E402
from lessons.l11_speculative.replay import ReplayDrafter, wrong_with_rate  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

# Resolved only when chosen: smollm2 is converted into the cache on first use, and needs its package installed.
MODELS: dict[str, Callable[[], Path]] = {"tiny": default_model_dir, "bench": bench_shape_dir,
                                         "smollm2": lambda: resolve_model_dir("smollm2", default_model_dir)}
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
    # The same product two ways: linear (x @ W.T, what the model runs) and W @ x.T (the weight as the left
    # operand), to show how much of a few rows' cost is the CPU kernel's choice rather than the arithmetic.
    forms = {"linear": lambda x: torch.nn.functional.linear(x, weight), "w_xt": lambda x: torch.mm(weight, x.t())}
    cells = [(m, form) for m in rows_asked for form in forms]
    times: dict[tuple[int, str], list[float]] = {c: [] for c in cells}
    with torch.inference_mode():
        for r, (m, form) in harness.alternate(cells, args.warmup + args.rounds):
            t0 = time.perf_counter()
            forms[form](xs[m])
            if r >= args.warmup:
                times[(m, form)].append(time.perf_counter() - t0)
    ms = {c: 1e3 * harness.percentiles(times[c], (50,))["p50"] for c in cells}
    one = ms[(rows_asked[0], "linear")]
    return [{"model": name, "shape": list(weight.shape), "rows": m, "ms": ms[(m, "linear")],
             "x_m1": ms[(m, "linear")] / one, "ms_w_xt": ms[(m, "w_xt")]} for m in rows_asked]


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
            f"{args.rounds} rounds); the same product as W @ x.T beside it", ("model", "weight", "M rows", "ms",
                                                                              "x M=1", "W @ x.T ms"),
            [[r["model"], " x ".join(map(str, r["shape"])), str(r["rows"]), f"{r['ms']:.2f}", f"{r['x_m1']:.2f}x",
              f"{r['ms_w_xt']:.2f}"] for r in mm]))
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"rows": rows, "free": args.free, "lm_head": mm}, conditions, console)
    if args.png:
        plot(rows, args.png, conditions, console)


# ----- speedup: the engine with drafts against itself without -----

TARGET = {"speedup": 2.0, "alpha": 0.8, "k": 4, "batch": 1, "model": "bench", "threads": 1}
ASK_LEN = 8  # tokens of each fixed "instruction" around a prompt's passage


def alphas(text: str) -> list[float]:
    try:
        values = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated rates, got {text!r}") from None
    if not values or values[0] < 0 or values[-1] > 1:
        raise argparse.ArgumentTypeError(f"acceptance rates between 0 and 1, got {text!r}")
    return values


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"LOW-HIGH token counts, got {text!r}") from None
    if not 2 * ASK_LEN < low <= high:
        raise argparse.ArgumentTypeError(f"LOW-HIGH with {2 * ASK_LEN} < LOW <= HIGH, got {text!r}")
    return low, high


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one verify row yields when each draft is right with probability alpha, independently, and the
    row stops at the first wrong one: 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_acceptance(alpha: float, k: int) -> float:
    """What SpecStats.acceptance_rate (accepted / drafted) reads under the same model: drafts behind the first
    wrong one count as drafted and not accepted, so it is (alpha + ... + alpha^k) / k, not alpha."""
    return sum(alpha ** j for j in range(1, k + 1)) / k


def repeat_prompts(batch: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """`batch` prompts shaped like "here is a passage: <passage>. Repeat it exactly:" -- the two instructions
    are fixed token ids shared by every prompt, the passage random ids (a random-weight model has no words,
    so any ids serve). Output that repeats its input is the n-gram drafter's case; the passage differs per
    prompt, so every prompt is distinct (the replay drafter looks outputs up by prompt)."""
    rng = random.Random(seed)
    top = min(vocab, 151643)  # ordinary tokens only
    before, after = [rng.randrange(top) for _ in range(ASK_LEN)], [rng.randrange(top) for _ in range(ASK_LEN)]
    prompts = [before + [rng.randrange(top) for _ in range(rng.randint(*lengths) - 2 * ASK_LEN)] + after
               for _ in range(batch)]
    if len({tuple(p) for p in prompts}) != batch:
        raise CourseError("two prompts came out equal; try another --seed")
    return prompts


def make_engine(model: Qwen3ForCausalLM, prompts: list[list[int]], drafter, args):
    """One fresh engine per run (no prefix cache or stats carried over): every request of the batch held at
    once, a budget that prefills the whole batch in one step and leaves room for K drafts per decode."""
    batch, longest = len(prompts), max(map(len, prompts))
    blocks = batch * blocks_for(longest + args.max_new_tokens + args.k + 1, BLOCK_SIZE)
    budget = max(batch * (args.k + 1), sum(map(len, prompts)))
    return L11Engine(model, BLOCK_SIZE, blocks, max_running=batch, backend=args.backend, graphs=True,
                     max_batched_tokens=budget, drafter=drafter, num_speculative_tokens=args.k, seed=args.seed)


class Run:
    """One engine running the batch to the end, a step at a time, all requests arriving together. A step is a
    decode step when every request had its first token before it (the prompts are done); only those are
    timed, so the ratio is decode's. Several runs can take turns step by step (see measure_batch)."""

    def __init__(self, model: Qwen3ForCausalLM, prompts: list[list[int]], drafter, args):
        self.engine = make_engine(model, prompts, drafter, args)
        stop = StopRule(args.max_new_tokens, ignore_eos=True)
        self.seqs = [self.engine.add_request(p, stop) for p in prompts]
        self.decode_s, self.decode_steps, self.decode_tokens = 0.0, 0, 0
        self.eager_before = self.engine.runner.eager_steps

    @property
    def busy(self) -> bool:
        return self.engine.scheduler.has_work()

    def step(self) -> None:
        decoding = all(seq.output_ids for seq in self.seqs)
        before = sum(len(seq.output_ids) for seq in self.seqs)
        t0 = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - t0
        if decoding:
            self.decode_s, self.decode_steps = self.decode_s + seconds, self.decode_steps + 1
            self.decode_tokens += sum(len(seq.output_ids) for seq in self.seqs) - before
        else:
            self.eager_before = self.engine.runner.eager_steps  # count the decode steps' eager forwards only

    def result(self) -> dict:
        engine, spec = self.engine, self.engine.spec
        if engine.allocator.num_free != engine.usable_blocks:
            raise RuntimeError(f"blocks leaked: {engine.allocator.num_free} free of {engine.usable_blocks}")
        return {"outputs": [list(seq.output_ids) for seq in self.seqs], "decode_s": self.decode_s,
                "decode_steps": self.decode_steps, "decode_tokens": self.decode_tokens,
                "eager_decode_steps": engine.runner.eager_steps - self.eager_before,
                "spec": {"drafted": spec.drafted, "accepted": spec.accepted, "verify_rows": spec.verify_rows,
                         "plain_rows": spec.plain_rows, "emitted": spec.emitted, "accepted_at": list(spec.accepted_at),
                         "acceptance_rate": spec.acceptance_rate, "mean_accepted_length": spec.mean_accepted_length},
                "backend": harness.backend_name(engine)}


def generate(model: Qwen3ForCausalLM, prompts: list[list[int]], drafter, args) -> dict:
    """One run alone, to the end."""
    run = Run(model, prompts, drafter, args)
    while run.busy:
        run.step()
    return run.result()


def systems(args) -> list[tuple[str, float | None]]:
    """(name, alpha): the plain engine, the replay drafter at each acceptance rate, the n-gram drafter."""
    return [("none", None)] + [(f"replay {a:g}", a) for a in args.alphas] + ([("ngram", None)] if args.ngram else [])


def drafter_for(name: str, alpha: float | None, expected: dict, vocab: int, seed: int):
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter()
    return ReplayDrafter(expected, vocab, wrong_with_rate(1 - alpha, seed))


def measure_batch(model: Qwen3ForCausalLM, batch: int, args, console: Console) -> tuple[list[dict], set[str]]:
    """Every system at one batch size: a reference run without drafts (untimed; its greedy outputs are what
    the replay drafter proposes and what every other run must produce), then --rounds rounds; in a round every
    system has its own fresh engine and they take turns a step at a time (harness.alternate). Round r
    corrupts with seed --seed + r, so the rounds see different draws of the same rate (one request of 64
    tokens is a small sample of it). Parity is checked on every run: a speculative output that differs stops
    the benchmark."""
    prompts = repeat_prompts(batch, args.prompt_len, model.config.vocab_size, args.seed + batch)
    reference = generate(model, prompts, None, args)
    expected = {tuple(p): out for p, out in zip(prompts, reference["outputs"])}
    names = systems(args)
    runs: dict[str, list[dict]] = {name: [] for name, _ in names}
    backends = {reference["backend"]}
    for r in range(args.warmup + args.rounds):
        vocab = model.config.vocab_size
        going = {name: Run(model, prompts, drafter_for(name, alpha, expected, vocab, args.seed + r), args)
                 for name, alpha in names}
        gc.collect()
        # Step by step in turns (forward, then backward, ...): a box that grows busier mid-round slows every
        # system's steps alike, not whichever ran last. No run needs more than max_new_tokens steps.
        for _, (name, _) in harness.alternate(names, args.max_new_tokens):
            if going[name].busy:
                going[name].step()
        for name, _ in names:
            if going[name].busy:
                raise RuntimeError(f"{name} still running after {args.max_new_tokens} steps")
            got = going[name].result()
            if got["outputs"] != reference["outputs"]:
                bad = next(i for i, (x, y) in enumerate(zip(got["outputs"], reference["outputs"])) if x != y)
                raise RuntimeError(f"parity broken: batch {batch}, {name}, request {bad}: output differs from the "
                                   "engine's own output without drafts; the speed-up of a wrong answer means nothing")
            backends.add(got["backend"])
            if r >= args.warmup:
                runs[name].append(got)
        del going  # the engines' pools go before the next round's are built
    console.print(f"batch {batch}: {len(names)} systems x {args.rounds} rounds, every output equal to the plain "
                  "engine's", markup=False, highlight=False)
    rows = summarize(batch, names, runs, args)
    outs = reference["outputs"]
    for row in rows:  # what the plain engine's own outputs look like: do they repeat, do they copy the prompt?
        row["output_distinct"] = sum(len(set(o)) for o in outs) / len(outs)
        row["output_in_prompt"] = sum(t in set(p) for p, o in zip(prompts, outs) for t in o) / sum(map(len, outs))
    return rows, backends


def summarize(batch: int, names: list[tuple[str, float | None]], runs: dict[str, list[dict]], args) -> list[dict]:
    """Per system, round r against the plain engine's round r: the speed-up (its decode time over this one's,
    the same tokens) and the step cost (time per decode step over its), medians over the rounds with their
    range; what speculation did, summed over the rounds."""
    base, rows = runs["none"], []
    for name, alpha in names:
        mine = runs[name]
        ratios = [b["decode_s"] / g["decode_s"] for b, g in zip(base, mine)]
        costs = [(g["decode_s"] / g["decode_steps"]) / (b["decode_s"] / b["decode_steps"]) for b, g in zip(base, mine)]
        total = {k: sum(g["spec"][k] for g in mine) for k in ("drafted", "accepted", "verify_rows", "plain_rows",
                                                              "emitted")}
        spec = {**total, "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
                "mean_accepted_length": 1 + total["accepted"] / total["verify_rows"] if total["verify_rows"] else 0.0}
        tokens, steps = sum(g["decode_tokens"] for g in mine), sum(g["decode_steps"] for g in mine)
        median = lambda xs: harness.percentiles(xs, (50,))["p50"]  # noqa: E731
        rows.append({
            "batch": batch, "system": name, "alpha": alpha, "decode_s_all": [g["decode_s"] for g in mine],
            "decode_steps_all": [g["decode_steps"] for g in mine], "decode_tokens": mine[0]["decode_tokens"],
            "eager_decode_steps": sum(g["eager_decode_steps"] for g in mine), "decode_steps": steps,
            "tokens_per_s": median([g["decode_tokens"] / g["decode_s"] for g in mine]),
            "speedup": median(ratios), "speedup_rounds": ratios, "step_cost": median(costs), "step_cost_rounds": costs,
            "tokens_per_forward": tokens / steps,
            "tokens_per_row": spec["emitted"] / (spec["verify_rows"] + spec["plain_rows"]) if name != "none" else 1.0,
            "tokens_per_row_rounds": [g["spec"]["emitted"] / max(1, g["spec"]["verify_rows"] + g["spec"]["plain_rows"])
                                      for g in mine] if name != "none" else [1.0] * len(mine),
            "formula": None if alpha is None else expected_tokens_per_step(alpha, args.k),
            "expected_acceptance": None if alpha is None else expected_acceptance(alpha, args.k), "spec": spec})
    return rows


def break_even(points: list[tuple[float, float]]) -> float | None:
    """The acceptance rate where the measured speed-up crosses 1, by linear interpolation between the two
    measured rates around the crossing; None when it never crosses (above 1 everywhere or below everywhere)."""
    for (a0, s0), (a1, s1) in zip(points, points[1:]):
        if s0 < 1 <= s1:
            return a0 + (1 - s0) * (a1 - a0) / (s1 - s0)
    return None


def formula_break_even(cost: float, k: int) -> float | None:
    """The alpha at which (1 - alpha^(k+1)) / (1 - alpha) tokens per step pay for a step costing `cost`
    plain decode steps (bisection: the formula grows from 1 at alpha 0 to k + 1 at alpha 1)."""
    if cost <= 1:
        return 0.0
    if cost >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < cost else (lo, mid)
    return (lo + hi) / 2


def verify_cost(rows: list[dict], batch: int) -> float | None:
    """A verify step's cost in plain decode steps, from the same run: the lowest replayed rate's time per step
    (at 0 every step carries K drafts and keeps one token) over the plain engine's."""
    replays = [r for r in rows if r["batch"] == batch and r["alpha"] is not None]
    return min(replays, key=lambda r: r["alpha"])["step_cost"] if replays else None


def target_verdict(rows: list[dict], args) -> str:
    t = TARGET
    say = (f"target: at acceptance {t['alpha']:g} and K = {t['k']}, >= {t['speedup']:g}x the plain engine's decode "
           f"throughput at batch {t['batch']} on the {t['model']} shape, {t['threads']} thread")
    cell = next((r for r in rows if r["batch"] == t["batch"] and r["alpha"] == t["alpha"]), None)
    setting = (args.model, args.k, args.threads) == (t["model"], t["k"], t["threads"])
    if cell is None or not setting:
        return f"{say}: not evaluated (this run is not that setting)"
    met = cell["speedup"] >= t["speedup"]
    low, high = min(cell["speedup_rounds"]), max(cell["speedup_rounds"])
    straddle = ", borderline: rounds on both sides of it" if low < t["speedup"] <= high else ""
    return (f"{say}: {'MET' if met else 'NOT MET'}{straddle} -- measured {cell['speedup']:.3f}x (median; rounds "
            f"{low:.2f}-{high:.2f}x), {cell['tokens_per_forward']:.2f} "
            f"tokens per target forward against the formula's {cell['formula']:.2f}, a verify step costing "
            f"{cell['step_cost']:.2f} plain decode steps (the formula over that cost: "
            f"{cell['formula'] / cell['step_cost']:.2f}x)")


def ngram_line(row: dict, args) -> str:
    """What the n-gram drafter found on prompts that ask to repeat a passage, and where it could have found
    it: the plain engine's outputs (random weights: they need not repeat anything)."""
    s, rounds = row["spec"], args.rounds
    per_row = s["drafted"] / s["verify_rows"] if s["verify_rows"] else 0.0
    found = (f"{s['drafted'] / rounds:.0f} drafts per run ({per_row:.2f} per verify row) over {row['decode_tokens']} "
             f"decode tokens, {s['acceptance_rate']:.0%} accepted, {row['tokens_per_row']:.2f} tokens per decode row, "
             f"speed-up {row['speedup']:.2f}x" if s["drafted"] else
             f"no drafts in {row['decode_tokens']} decode tokens per run, speed-up {row['speedup']:.2f}x")
    if row["output_in_prompt"] > 0:
        source = f"{row['output_in_prompt']:.0%} of their tokens appear in their prompt"
    elif s["drafted"]:
        source = "none of their tokens appears in their prompt: what it finds is the output repeating itself"
    else:
        source = "none of their tokens appears in their prompt: the model never repeats the passage"
    return (f"batch {row['batch']}, n-gram drafter (max n 4, min n 2): {found}. The plain engine's outputs hold "
            f"{row['output_distinct']:.1f} distinct tokens each (of {args.max_new_tokens}) and {source}.")


def plot_speedup(rows: list[dict], args, path: str, conditions: harness.Conditions, console: Console) -> None:
    import numpy as np

    fig, axes = harness.figure(1, 1, figsize=(6.4, 4.6), squeeze=False)
    ax = axes[0][0]
    grid = np.linspace(0, 1, 101)
    ax.plot(grid, [expected_tokens_per_step(a, args.k) for a in grid], "k--", lw=1,
            label=f"(1 - α^{args.k + 1}) / (1 - α): tokens per verify step")
    for i, b in enumerate(args.batches):
        color = f"C{i}"
        pts = [r for r in rows if r["batch"] == b and r["alpha"] is not None]
        ax.plot([r["alpha"] for r in pts], [r["speedup"] for r in pts], "-o", color=color, label=f"batch {b} measured")
        cost = verify_cost(rows, b)
        if cost:
            ax.plot(grid, [expected_tokens_per_step(a, args.k) / cost for a in grid], ":", color=color, lw=1,
                    label=f"batch {b}: formula / verify cost {cost:.2f}")
        ng = next((r for r in rows if r["batch"] == b and r["system"] == "ngram"), None)
        if ng is not None:
            ax.plot([ng["spec"]["acceptance_rate"]], [ng["speedup"]], "x", color=color, ms=8)
    ax.axhline(1, color="0.5", lw=0.8)
    ax.plot([TARGET["alpha"]], [TARGET["speedup"]], "*", color="red", ms=10, label="target (batch 1)")
    ax.set_xlabel("acceptance rate α (replay drafter: each draft right with probability α)")
    ax.set_ylabel("decode throughput / plain engine's")
    ax.set_title(f"{args.model}: speculative decoding, K = {args.k} (x: n-gram drafter at its measured rate)",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    harness.save_png(fig, path, conditions, console)


def speedup(args) -> None:
    torch.set_num_threads(args.threads)
    console = Console(width=150)
    conditions = harness.start("cpu", torch.float32, threads=args.threads)
    model = Qwen3ForCausalLM.from_dir(MODELS[args.model](), torch.float32, torch.device("cpu"))
    rows, used = [], set()
    for b in args.batches:
        got, backends = measure_batch(model, b, args, console)
        rows += got
        used |= backends
    conditions.backend = ",".join(sorted(used))
    conditions.extra.update(model=args.model, K=str(args.k), prompt=f"{args.prompt_len[0]}-{args.prompt_len[1]}",
                            new=str(args.max_new_tokens), rounds=str(args.rounds))
    table = []
    for r in rows:
        s = r["spec"]
        table.append([str(r["batch"]), r["system"].split()[0], "-" if r["alpha"] is None else f"{r['alpha']:g}",
                      "-" if r["system"] == "none" else f"{s['acceptance_rate']:.2f}",
                      harness.fmt(r["expected_acceptance"], digits=2),
                      "-" if r["system"] == "none" else f"{s['mean_accepted_length']:.2f}",
                      harness.fmt(r["formula"], digits=2), f"{r['tokens_per_row']:.2f}",
                      f"{r['tokens_per_forward']:.2f}", f"{r['step_cost']:.2f}x", f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup']:.2f}x",
                      f"{min(r['speedup_rounds']):.2f}-{max(r['speedup_rounds']):.2f}"])
    console.print(harness.table(
        f"{args.model}: L11's engine with drafts against itself without (decode steps only, median of {args.rounds} "
        f"rounds, K = {args.k}, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, {args.max_new_tokens} new "
        "tokens each, EOS ignored)",
        ("batch", "drafter", "α", "acc/drafted", "expected", "acc. len", "formula", "tok/row", "tok/fwd",
         "step cost", "decode tok/s", "speed-up", "rounds"), table))
    for b in args.batches:
        pts = [(r["alpha"], r["speedup"]) for r in rows if r["batch"] == b and r["alpha"] is not None]
        measured, cost = break_even(pts), verify_cost(rows, b)
        from_formula = formula_break_even(cost, args.k) if cost else None
        ng = next((r for r in rows if r["batch"] == b and r["system"] == "ngram"), None)
        if measured is not None:
            crossed = f"{measured:.2f} (measured, interpolated)"
        elif pts and min(s for _, s in pts) >= 1:
            crossed = f"none: faster than the plain engine at every rate measured, {pts[0][0]:g} included"
        else:
            crossed = f"none: slower than the plain engine at every rate measured, up to {pts[-1][0]:g}" if pts else "-"
        line = f"batch {b}: break-even acceptance {crossed}"
        if cost is not None:
            line += (f"; a verify step costs {cost:.2f} plain decode steps, so the formula breaks even at "
                     f"{'no rate' if from_formula is None else f'{from_formula:.2f}'}")
        console.print(line, markup=False, highlight=False, soft_wrap=True)
        if ng is not None:
            console.print(ngram_line(ng, args), markup=False, highlight=False, soft_wrap=True)
    console.print("α: the replay drafter's rate (each draft right with probability α, independently); acc/drafted: "
                  "SpecStats.acceptance_rate, measured; expected: (α + ... + α^K) / K, what acc/drafted reads under "
                  "that model (drafts behind the first wrong one count as drafted); acc. len: mean accepted length "
                  "(tokens per verify row); formula: (1 - α^(K+1)) / (1 - α), its expectation; tok/row: tokens per "
                  "decode row, plain rows included (the last rows of a request carry fewer drafts); tok/fwd: decode "
                  "tokens per target forward (the batch's); step cost: time per decode step over the plain engine's; "
                  "speed-up: the plain engine's decode time over this one's (same tokens), median of the rounds, and "
                  "its range round by round. Graphs on (the engine's default): plain decode steps replay L7's "
                  "static-buffer step (on CPU no CUDA graph exists: the same buffers, run eagerly); a step holding "
                  "any verify slice runs L8's eager path.",
                  markup=False, highlight=False, soft_wrap=True)
    console.print(target_verdict(rows, args), markup=False, highlight=False, soft_wrap=True)
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"rows": rows, "k": args.k, "target": TARGET,
                                       "verdict": target_verdict(rows, args)}, conditions, console)
    if args.png:
        plot_speedup(rows, args, args.png, conditions, console)


def parser() -> OneLineParser:
    p = OneLineParser(prog="l11_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("curve", help="one forward's time against query tokens per request")
    c.add_argument("--models", type=names, default="tiny,bench", help=f"of {', '.join(MODELS)} (default tiny,bench)")
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

    s = sub.add_parser("speedup", help="the engine with drafts against itself without, per batch and drafter")
    s.add_argument("--model", choices=list(MODELS), default="bench", help="bench (default), tiny or smollm2")
    s.add_argument("--batches", type=ints, default="1,4,16")
    s.add_argument("--alphas", type=alphas, default="0,0.5,0.8,1", help="the replay drafter's acceptance rates")
    s.add_argument("--k", type=int, default=4, help="drafts per verify step (num_speculative_tokens, default 4)")
    s.add_argument("--prompt-len", type=span, default="32-64", help="prompt tokens, LOW-HIGH (default 32-64)")
    s.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per request (EOS ignored)")
    s.add_argument("--rounds", type=int, default=8, help="timed rounds (default 8)")
    s.add_argument("--warmup", type=int, default=0, help="untimed rounds after the reference run (default 0)")
    s.add_argument("--no-ngram", dest="ngram", action="store_false", help="skip the n-gram drafter")
    s.add_argument("--backend", default="auto", choices=BACKENDS)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", metavar="PATH")
    s.add_argument("--png", metavar="PATH")
    s.set_defaults(run=speedup)
    return p


def main() -> None:
    args = parser().parse_args()
    try:
        if getattr(args, "history", 1) < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1:
            raise CourseError("--history, --rounds and --threads must be at least 1, --warmup at least 0")
        if args.command == "speedup" and (args.k < 1 or args.max_new_tokens < 2):
            raise CourseError("--k must be at least 1 and --max-new-tokens at least 2")
        args.run(args)
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

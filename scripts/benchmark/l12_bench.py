"""int8 KV against bf16 and fp32 KV in the same pool bytes, in one run: what fits, what it decodes, what one
layer's attention reads.

    OMP_NUM_THREADS=1 python scripts/benchmark/l12_bench.py [--model bench|tiny|smollm2] [--pool-mib 16] [--prompt-len 128]
        [--new-tokens 32] [--rounds 5] [--histories 512,2048,8192] [--attn-batch 8] [--attn-rounds 9] [--json PATH]

a. Capacity: L12Engine's pool sized in bytes (--pool-mib) for each KV storage dtype: the blocks it holds (read
   from the engine) and how many requests of --prompt-len + --new-tokens tokens fit at once (none preempted).
b. Decode throughput at that concurrency: each system gets as many requests as its pool holds, all at once, a
   token budget that prefills them in one step, then only decode steps are timed (eager steps, graphs=False, so
   a batch computes exactly its rows). Systems: fp32 KV (fp32 model, kv_dtype auto), bf16 KV (bf16 model, auto),
   int8 KV on the fp32 model and on the bf16 model. Per round a fresh engine per system, the engines taking
   turns a step at a time in harness.alternate's order; the median of --rounds rounds is reported.
c. One layer's decode attention in L3's C++ kernel (CppBackend: plan once, run timed), Qwen3-8B's per-layer
   heads (32 query, 8 KV heads, D 128), --attn-batch decodes at each history, pages shuffled over the pool:
   fp32, bf16 and int8 pages (q fp32 for fp32 and int8 pages, bf16 for bf16's), each checked against the torch
   oracle first. Beside each, the memory floor measured the same way: one torch sum over a buffer of the bytes
   that attention must read (every K and V row once), timed in the same alternating rounds.
Targets: int8 holds >= 1.9x the bf16 blocks in the same bytes; int8 decode attention is no slower than bf16's.
"""
from __future__ import annotations

import argparse
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
from attention_bench import median_times  # noqa: E402
from bench_systems import bench_shape_dir  # noqa: E402
from l11_bench import ints  # noqa: E402
from lessons.l2_token_flat.engine import blocks_for  # noqa: E402
from lessons.l2_token_flat.request import Request  # noqa: E402
from lessons.l3_block_tensor.backends import TorchBackend  # noqa: E402
from lessons.l3_block_tensor.backends.cpp_backend import CppBackend  # noqa: E402
from lessons.l3_block_tensor.batch_meta import BatchMeta  # noqa: E402
from lessons.l12_kv_quant.backends import DequantTorchBackend, int8_backend  # noqa: E402
from lessons.l12_kv_quant.engine import L12Engine  # noqa: E402
from lessons.l12_kv_quant.quantize import SCALE_BYTES, pack_rows  # noqa: E402
from scripts.launch_count import qwen3_config  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

# Resolved only when chosen: smollm2 is converted into the cache on first use, and needs its package installed.
MODELS: dict[str, Callable[[], Path]] = {"tiny": default_model_dir, "bench": bench_shape_dir,
                                         "smollm2": lambda: resolve_model_dir("smollm2", default_model_dir)}
BLOCK = 16
MIB = 1024**2
# name -> (model dtype, kv_dtype): the model's dtype decides what "auto" stores
SYSTEMS = {"fp32 KV": (torch.float32, "auto"), "bf16 KV": (torch.bfloat16, "auto"),
           "int8 KV, fp32 model": (torch.float32, "int8"), "int8 KV, bf16 model": (torch.bfloat16, "int8")}
HQ, HKV, D = 32, 8, 128  # Qwen3-8B's heads per layer
BLOCKS_TARGET = 1.9
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class Run:
    """One system's requests, all at once on a fresh engine: one prefill step, then decode steps, timed. Runs take
    turns a step at a time (capacity_and_decode), so a box that gets busier mid-round slows every system alike."""

    def __init__(self, model: Qwen3ForCausalLM, kv_dtype: str, prompts: list[list[int]], args):
        n = len(prompts)
        self.engine = L12Engine(model, BLOCK, None, max_running=n, kv_dtype=kv_dtype, graphs=False,
                                kv_bytes=int(args.pool_mib * MIB), max_batched_tokens=n * args.prompt_len)
        self.seqs = [self.engine.add_request(p, StopRule(args.new_tokens, ignore_eos=True)) for p in prompts]
        self.peak, self.decode_s, self.steps, self.tokens = 0, 0.0, 0, 0

    def step(self) -> None:
        seqs = self.seqs
        decoding, before = all(s.output_ids for s in seqs), sum(len(s.output_ids) for s in seqs)
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        self.peak = max(self.peak, len(self.engine.scheduler.running))
        if decoding:
            self.decode_s, self.steps = self.decode_s + dt, self.steps + 1
            self.tokens += sum(len(s.output_ids) for s in seqs) - before

    def result(self) -> dict:
        return {"peak_running": self.peak, "preemptions": self.engine.stats.preemptions, "decode_s": self.decode_s,
                "steps": self.steps, "tokens": self.tokens, "backend": harness.backend_name(self.engine)}


def capacity_and_decode(args, console: Console) -> tuple[list[dict], set[str]]:
    model_dir = MODELS[args.model]()
    models = {dt: Qwen3ForCausalLM.from_dir(model_dir, dt, torch.device("cpu")) for dt in (torch.float32, torch.bfloat16)}
    cfg = models[torch.float32].config
    per_request = blocks_for(args.prompt_len + args.new_tokens, BLOCK)
    rng = random.Random(args.seed)
    rows, runs = {}, {name: [] for name in SYSTEMS}
    for name, (dtype, kv) in SYSTEMS.items():  # how many requests each pool holds, from the engine itself
        blocks = L12Engine(models[dtype], BLOCK, None, max_running=1, kv_dtype=kv, kv_bytes=int(args.pool_mib * MIB),
                           graphs=False).usable_blocks
        n = blocks // per_request
        if n < 1:
            raise CourseError(f"--pool-mib {args.pool_mib:g} holds no request of {per_request} blocks for {name}")
        rows[name] = {"system": name, "kv": "int8" if kv == "int8" else NAMES[dtype], "blocks": blocks, "requests": n,
                      "head_dim": cfg.head_dim}
    prompts = [[rng.randrange(min(cfg.vocab_size, 151643)) for _ in range(args.prompt_len)]
               for _ in range(max(r["requests"] for r in rows.values()))]
    for r in range(args.rounds):
        with torch.inference_mode():
            live = {name: Run(models[dt], kv, prompts[:rows[name]["requests"]], args) for name, (dt, kv) in SYSTEMS.items()}
            for _, name in harness.alternate(list(SYSTEMS), 10**9):  # a step each, in turns, until all finish
                if not any(run.engine.scheduler.has_work() for run in live.values()):
                    break
                if live[name].engine.scheduler.has_work():
                    live[name].step()
        for name, run in live.items():
            runs[name].append(run.result())
        console.print(f"  round {r + 1}: " + ", ".join(f"{name} {run.decode_s:.2f} s" for name, run in live.items())
                      + " of decode", highlight=False)
    for name, row in rows.items():
        rs = sorted(runs[name], key=lambda r: r["tokens"] / r["decode_s"])
        mid = rs[len(rs) // 2]  # the median round (the upper one of two)
        row.update(tok_s=mid["tokens"] / mid["decode_s"], step_ms=1e3 * mid["decode_s"] / mid["steps"],
                   tok_s_range=[r["tokens"] / r["decode_s"] for r in (rs[0], rs[-1])],
                   peak_running=max(r["peak_running"] for r in rs), preemptions=max(r["preemptions"] for r in rs))
    return list(rows.values()), {r["backend"] for rs in runs.values() for r in rs}


def pages(history: int, batch: int, seed: int) -> tuple[BatchMeta, dict[str, tuple]]:
    """`batch` decodes of `history` tokens each, pages shuffled; (q, K, V) per page format."""
    g = torch.Generator().manual_seed(seed)
    n_pages = batch * blocks_for(history, BLOCK)
    free = torch.randperm(n_pages, generator=g).tolist()
    reqs = [Request(list(range(history)), BLOCK, blocks=[free.pop() for _ in range(blocks_for(history, BLOCK))],
                    num_cached=history - 1) for _ in range(batch)]
    meta = BatchMeta.build(reqs, BLOCK, torch.device("cpu"))
    k, v = (torch.randn(n_pages, BLOCK, HKV, D, generator=g) for _ in range(2))
    q = torch.randn(batch, HQ, D, generator=g)
    return meta, {"fp32": (q, k, v), "bf16": (q.bfloat16(), k.bfloat16(), v.bfloat16()),
                  "int8": (q, pack_rows(k), pack_rows(v))}


def attention(args, console: Console) -> list[dict]:
    rows = []
    for history in args.histories:
        meta, data = pages(history, args.attn_batch, args.seed)
        tokens = args.attn_batch * history
        fns, read = {}, {}
        for fmt, (q, k, v) in data.items():
            oracle = DequantTorchBackend() if fmt == "int8" else TorchBackend()
            kernel = CppBackend()
            oracle.plan(meta), kernel.plan(meta)
            tol = 1e-4 if fmt == "fp32" else 2e-2
            torch.testing.assert_close(kernel.run(q, k, v, meta).float(), oracle.run(q, k, v, meta).float(),
                                       rtol=tol, atol=tol, msg=lambda m: f"{fmt}, history {history}: {m}")
            read[fmt] = 2 * tokens * HKV * k.shape[-1] * k.element_size()  # every K and V row once
            buffer = torch.ones(read[fmt] // 4)
            fns[fmt] = lambda kernel=kernel, q=q, k=k, v=v: kernel.run(q, k, v, meta)
            fns[f"floor {fmt}"] = buffer.sum
        t = median_times(fns, args.attn_rounds, args.attn_calls)
        for fmt in data:
            rows.append({"history": history, "format": fmt, "ms": 1e3 * t[fmt], "floor_ms": 1e3 * t[f"floor {fmt}"],
                         "bytes": read[fmt], "bytes_per_token": read[fmt] // tokens})
        console.print(f"  history {history:,}: " + ", ".join(f"{f} {1e3 * t[f]:.3f} ms" for f in data), highlight=False)
    return rows


def report(cap: list[dict], attn: list[dict], args, console: Console) -> list[str]:
    by = {r["system"]: r for r in cap}
    bf16 = by["bf16 KV"]
    console.print(harness.table(
        f"a + b. {args.model} model, a pool of {args.pool_mib:g} MiB, blocks of {BLOCK}; requests of {args.prompt_len} "
        f"prompt + {args.new_tokens} new tokens ({blocks_for(args.prompt_len + args.new_tokens, BLOCK)} blocks each), "
        f"all at once; decode steps only, median of {args.rounds} round(s), 1 step per token per request",
        ["system", "KV", "blocks", "x bf16", "requests", "peak running", "preempted", "decode step", "decode tok/s",
         "rounds", "x bf16 KV"],
        [[r["system"], r["kv"], f"{r['blocks']:,}", f"{r['blocks'] / bf16['blocks']:.3f}x", str(r["requests"]),
          str(r["peak_running"]), str(r["preemptions"]), f"{r['step_ms']:.1f} ms", f"{r['tok_s']:,.0f}",
          f"{r['tok_s_range'][0]:,.0f}-{r['tok_s_range'][1]:,.0f}", f"{r['tok_s'] / bf16['tok_s']:.2f}x"]
         for r in cap]))
    ratio = {h: {r["format"]: r for r in attn if r["history"] == h} for h in args.histories}
    console.print(harness.table(
        f"c. one layer's decode attention, C++ kernel: {args.attn_batch} decodes per history, Hq {HQ}, Hkv {HKV}, "
        f"D {D}, median of {args.attn_rounds} alternating rounds x {args.attn_calls} calls; floor: one sum over the "
        "same bytes, same rounds",
        ["history", "format", "bytes/token", "MiB read", "kernel ms", "floor ms", "floor share", "int8/bf16 time",
         "int8/bf16 bytes"],
        [[f"{r['history']:,}", r["format"], f"{r['bytes_per_token']:,}", f"{r['bytes'] / MIB:,.1f}", f"{r['ms']:.3f}",
          f"{r['floor_ms']:.3f}", f"{r['floor_ms'] / r['ms']:.0%}",
          f"{r['ms'] / ratio[r['history']]['bf16']['ms']:.2f}x" if r["format"] == "int8" else "",
          f"{r['bytes'] / ratio[r['history']]['bf16']['bytes']:.3f}x" if r["format"] == "int8" else ""]
         for r in attn]))
    big = qwen3_config("Qwen3-8B")
    shapes = [(f"{args.model} model (D {bf16['head_dim']})", by["int8 KV, fp32 model"]["blocks"] / bf16["blocks"]),
              (f"Qwen3-8B's KV (D {big.head_dim})", 2 * big.head_dim / (big.head_dim + SCALE_BYTES))]
    times = [ratio[h]["int8"]["ms"] / ratio[h]["bf16"]["ms"] for h in args.histories]
    return [f"target: int8 holds >= {BLOCKS_TARGET}x the bf16 blocks in the same bytes: " + "; ".join(
                f"{name} {x:.3f}x {'MET' if x >= BLOCKS_TARGET else 'NOT MET'}" for name, x in shapes),
            "target: int8 decode attention no slower than bf16's (C++ kernel, same histories): " + ", ".join(
                f"{h:,} tokens {x:.2f}x" for h, x in zip(args.histories, times))
            + f" of bf16's time: {'MET' if max(times) <= 1 else 'NOT MET'}"]


def parser() -> OneLineParser:
    p = OneLineParser(prog="l12_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="bench", help="bench (default), tiny or smollm2, for a and b")
    p.add_argument("--pool-mib", type=float, default=16, help="KV pool bytes for every system (default 16 MiB)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request, EOS ignored (default 32)")
    p.add_argument("--rounds", type=int, default=5, help="decode rounds (default 5)")
    p.add_argument("--histories", type=ints, default="512,2048,8192", help="attention history lengths (c)")
    p.add_argument("--attn-batch", type=int, default=8, help="decodes per attention call (default 8)")
    p.add_argument("--attn-rounds", type=int, default=9, help="alternating attention rounds (default 9)")
    p.add_argument("--attn-calls", type=int, default=3, help="calls per round (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    return p


def planned(args, env: dict[str, str], measured_device: str) -> dict[str, str]:
    """What this command runs with today (tests/test_doc_measured.py): the CPU, both model dtypes, the
    backends the fp32/bf16 engines and the int8 engines pick, the thread count its command line sets."""
    backends = {harness.resolve_backend("auto", "cpu", torch.float32), int8_backend("auto", torch.device("cpu")).name}
    out = {"device": "cpu", "dtype": "float32,bfloat16", "backend": ",".join(sorted(backends | {"cpp"}))}
    if "OMP_NUM_THREADS" in env:
        out["threads"] = env["OMP_NUM_THREADS"]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    console = Console(width=160)
    try:
        if min(args.pool_mib, args.prompt_len, args.rounds, args.attn_batch, args.attn_rounds, args.attn_calls) <= 0 \
                or args.new_tokens < 2:
            raise CourseError("sizes, rounds and calls must be positive, --new-tokens at least 2")
        conditions = harness.start("cpu", "float32,bfloat16")
        conditions.extra.update(model=args.model, pool=f"{args.pool_mib:g} MiB",
                                requests=f"{args.prompt_len}+{args.new_tokens}", rounds=str(args.rounds))
        console.print("[bold]L12 quantized-KV benchmark[/]: same pool bytes, int8 against bf16 and fp32 KV")
        cap, used = capacity_and_decode(args, console)
        attn = attention(args, console)
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    conditions.backend = ",".join(sorted(used | {"cpp"}))
    verdicts = report(cap, attn, args, console)
    for line in verdicts:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"capacity_decode": cap, "attention": attn, "targets": verdicts}, conditions,
                           console)


if __name__ == "__main__":
    main()

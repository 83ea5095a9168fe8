"""Time the CPU attention backends against each other, in one process, and print the ratios.

Part 1: one layer's `run` on a decode batch (random K/V in scattered pages): the torch oracle, the batched
backend and the C++ kernel (when it builds), timed in alternating rounds so a busy machine slows all alike,
beside the memory floor: the K/V bytes the batch reads over this machine's streaming-read rate, measured in
the same run. Part 2: one layer's `run` on prefill rows: 4 slices of 64 rows after 640-token histories (L8's
chunked prefill) and one whole 512-token prompt. Every backend's output is checked against the oracle's
first. --threads-scaling: the C++ kernel alone at 1 and 2 threads on each case, and the ratio. --engine: a
whole L4 run on the embedded model with each backend, checking the tokens are identical. Pin the thread
count (OMP_NUM_THREADS=1); the conditions line (commit, CPU, threads, backends, load) is printed last:
the ratios are the claim, not the times.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's lessons/ and shared/, not an installed course's
import harness  # noqa: E402  (scripts/benchmark/, this script's folder)
from lessons.l2_token_flat.request import Request  # noqa: E402
from lessons.l3_block_tensor.backends import BatchedBackend, TorchBackend  # noqa: E402
from lessons.l3_block_tensor.backends.cpp_backend import CppBackend, KernelUnavailable  # noqa: E402
from lessons.l3_block_tensor.batch_meta import BatchMeta  # noqa: E402

DRAM_BYTES = 1024**3  # a read this large comes from DRAM on any machine the course runs on (largest L3 seen: 480 MiB)
# (history length, new rows) per request: L8's slices of a long prompt, and one whole prompt
PREFILL_CASES = {"4 x 64-row slices after 640-token histories": [(704, 64)] * 4,
                 "one whole 512-token prompt": [(512, 512)]}
console = Console(width=150)


def cpu_backends() -> dict[str, Callable[[], object]]:
    """name -> backend class, the oracle first (the baseline); the C++ kernel only where it builds."""
    backends: dict[str, Callable[[], object]] = {"torch": TorchBackend, "batched": BatchedBackend}
    try:
        CppBackend()
        backends["cpp"] = CppBackend
    except KernelUnavailable as e:
        print(f"cpp: not timed: {e}")
    return backends


def read_rate(nbytes: int) -> float:
    """Bytes per second one reduction streams through a buffer of `nbytes` (the thread count as set). Summed again
    and again, a buffer that fits a cache is read from there, as the bench's K/V is by repeated run() calls."""
    x = torch.ones(nbytes // 4)
    return nbytes / median_times({"sum": lambda: x.sum()}, rounds=5, calls=3)["sum"]


def make_batch(rows: list[tuple[int, int]], args: argparse.Namespace, seed: int = 0
               ) -> tuple[BatchMeta, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One request per (history length, new rows), its pages shuffled over the pool, random q, K and V."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // args.block_size) for n, _ in rows]
    free = torch.randperm(sum(pages), generator=g).tolist()
    reqs = [Request(list(range(n)), args.block_size, blocks=[free.pop() for _ in range(p)], num_cached=n - new)
            for (n, new), p in zip(rows, pages)]
    meta = BatchMeta.build(reqs, args.block_size, torch.device("cpu"))
    shape = (sum(pages), args.block_size, args.hkv, args.head_dim)
    dtype = getattr(torch, args.dtype)
    k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    return meta, torch.randn(meta.num_tokens, args.hq, args.head_dim, generator=g).to(dtype), k, v


def decode_rows(args: argparse.Namespace) -> list[tuple[int, int]]:
    """`requests` decodes with histories evenly spread over min..max history."""
    step = (args.max_history - args.min_history) / max(1, args.requests - 1)
    return [(round(args.min_history + i * step), 1) for i in range(args.requests)]


def decode_batch(args: argparse.Namespace) -> tuple[BatchMeta, torch.Tensor, torch.Tensor, torch.Tensor]:
    return make_batch(decode_rows(args), args)


def checked_backends(meta: BatchMeta, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: str,
                     names: list[str] | None = None) -> dict[str, object]:
    """Each backend planned for `meta`, after its output matched the oracle's within the tests' tolerances."""
    classes = cpu_backends()
    backends = {name: cls() for name, cls in classes.items() if names is None or name in names}
    oracle = TorchBackend()
    oracle.plan(meta)
    tol = 1e-5 if dtype == "float32" else 2e-2  # the tolerances of tests/test_l3_batched_backend.py
    want = oracle.run(q, k, v, meta)
    for name, b in backends.items():
        b.plan(meta)
        torch.testing.assert_close(b.run(q, k, v, meta), want, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    return backends


def median_times(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each fn, over `rounds` rounds taken in harness.alternate's order."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up: first-call allocations and lazy init stay out of the numbers
    for _, name in harness.alternate(list(fns), rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fns[name]()
        times[name].append((time.perf_counter() - t0) / calls)
    return {name: harness.percentiles(ts, (50,))["p50"] for name, ts in times.items()}


def ratios(t: dict[str, float], scale: float = 1e3) -> list[str]:
    """Each backend's time (seconds x `scale`), then how many times faster than the oracle the others are, and
    the kernel than batched."""
    cells = [harness.fmt(secs * scale, digits=3) for secs in t.values()]
    cells += [f"{t['torch'] / t[name]:.2f}x" for name in t if name != "torch"]
    if "cpp" in t:
        cells.append(f"{t['batched'] / t['cpp']:.2f}x")
    return cells


def columns(names: list[str], first: str) -> list[str]:
    return [first, *[f"{n} ms" for n in names], *[f"{n} vs torch" for n in names if n != "torch"],
            *(["cpp vs batched"] if "cpp" in names else [])]


def layer_runs(args: argparse.Namespace) -> list[str]:
    """Part 1 and 2 in one table, one row per case; the decode row also gets the memory floor. Returns the
    backends timed."""
    meta, q, k, v = decode_batch(args)
    backends = checked_backends(meta, q, k, v, args.dtype)
    names = list(backends)
    # What any kernel must read: every K and V row of each request's history, once. The sum that gives the rate
    # runs in the same alternating rounds as the backends, so a machine that gets busier slows both alike.
    kv_tokens = int(meta.kv_last_page_len.sum()) + args.block_size * int((meta.kv_indptr.diff() - 1).sum())
    kv_bytes = 2 * kv_tokens * args.hkv * args.head_dim * k.element_size()
    buffer = torch.ones(kv_bytes // 4)
    t = median_times({**{name: (lambda b=b: b.run(q, k, v, meta)) for name, b in backends.items()},
                      "floor": lambda: buffer.sum()}, args.rounds, args.calls)
    floor = t.pop("floor")
    rate, dram_rate = kv_bytes / floor, read_rate(DRAM_BYTES)
    fastest = names[-1]
    decode = f"{args.requests} decodes, histories {args.min_history}..{args.max_history}"
    rows = [[decode, *ratios(t), f"{floor / t[fastest]:.1%}"]]
    if not args.no_prefill:
        for case, case_rows in PREFILL_CASES.items():
            meta, q, k, v = make_batch(case_rows, args)
            backends = checked_backends(meta, q, k, v, args.dtype)
            t = median_times({name: (lambda b=b: b.run(q, k, v, meta)) for name, b in backends.items()},
                             args.rounds, max(1, args.calls // 4))
            rows.append([case, *ratios(t), "-"])
    console.print(harness.table(
        f"one layer's run(), S={args.block_size}, Hq={args.hq}, Hkv={args.hkv}, D={args.head_dim}, {args.dtype}, "
        f"{torch.get_num_threads()} thread(s), median of {args.rounds} alternating rounds; every output matches "
        "the oracle's", [*columns(names, "case"), f"{fastest} share of the memory floor"], rows))
    print(f"memory floor {floor * 1e3:.3f} ms: the {args.requests} decodes read {kv_bytes / 2**20:.1f} MiB of K/V "
          f"({kv_tokens:,} tokens x {args.hkv} KV heads x {args.head_dim} x {k.element_size()} B, K and V) once, at "
          f"the rate one sum reads a buffer of that size ({rate / 1e9:.1f} GB/s, timed in the same rounds, same "
          f"threads); from DRAM (a 1 GiB sum, {dram_rate / 1e9:.1f} GB/s) it would be "
          f"{kv_bytes / dram_rate * 1e3:.3f} ms")
    return names


def threads_scaling(args: argparse.Namespace) -> None:
    """The C++ kernel at 1 and 2 threads on each case, alternating, planned at each count (plan() splits KV
    heads when row tiles are fewer than threads). The ratio is only as good as the machine is idle."""
    threads = torch.get_num_threads()
    cases = {f"decode batch ({args.requests} decodes)": decode_rows(args), **PREFILL_CASES}
    rows = []
    try:
        for case, case_rows in cases.items():
            meta, q, k, v = make_batch(case_rows, args)
            kernel = checked_backends(meta, q, k, v, args.dtype, names=["cpp"])["cpp"]

            def at(n: int) -> Callable[[], object]:
                def go() -> object:
                    torch.set_num_threads(n)
                    kernel.plan(meta)  # once per step, as the engine does; its cost is in the figure
                    return [kernel.run(q, k, v, meta) for _ in range(4)]
                return go

            t = median_times({"1 thread": at(1), "2 threads": at(2)}, args.rounds, max(1, args.calls // 4))
            rows.append([case, harness.fmt(t["1 thread"] / 4 * 1e3, digits=3),
                         harness.fmt(t["2 threads"] / 4 * 1e3, digits=3), f"{t['1 thread'] / t['2 threads']:.2f}x"])
    finally:
        torch.set_num_threads(threads)
    console.print(harness.table(f"the C++ kernel at 1 and 2 threads, {args.dtype}, plan() + 4 run() calls per "
                                "timing, ms per run()", ["case", "1 thread ms", "2 threads ms", "ratio"], rows))


def engine_run(args: argparse.Namespace) -> None:
    from lessons.l4_continuous import L4Engine
    from shared.generation import StopRule
    from shared.cli import resolve_model_dir
    from shared.model import Qwen3ForCausalLM
    from shared.tiny_qwen3 import default_model_dir

    model = Qwen3ForCausalLM.from_dir(resolve_model_dir(args.model, default_model_dir), torch.float32,
                                      torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    step = (args.max_history - args.min_history) / max(1, args.requests - 1)
    top = min(model.config.vocab_size, 151_000)  # ordinary tokens of either vocabulary
    prompts = [torch.randint(0, top, (round(args.min_history + i * step),), generator=g).tolist()
               for i in range(args.requests)]
    stop = StopRule(args.new_tokens, ignore_eos=True)
    # Room for every request at once: backpressure would change the batches the two backends see.
    num_blocks = sum(-(-(len(p) + args.new_tokens) // args.block_size) for p in prompts)
    out: dict[str, list[list[int]]] = {}
    used: dict[str, str] = {}

    def run(name: str) -> Callable[[], None]:
        def go() -> None:
            engine = L4Engine(model, args.block_size, num_blocks, backend=name)
            used[name] = harness.backend_name(engine)
            out[name] = engine.generate_batch(prompts, stop)
        return go

    t = median_times({name: run(name) for name in cpu_backends()}, rounds=args.engine_rounds, calls=1)
    assert all(tokens == out["torch"] for tokens in out.values()), "the backends disagree on the tokens"
    assert all(used[name] == name for name in used), f"an engine fell back to another backend: {used}"
    console.print(harness.table(
        f"whole L4 run: {args.model or 'embedded model'}, fp32, {args.requests} prompts of {args.min_history}..{args.max_history} "
        f"tokens, {args.new_tokens} new tokens each, S={args.block_size}, median of {args.engine_rounds} "
        "alternating rounds: identical tokens", [c.replace(" ms", " s") for c in columns(list(t), "run")],
        [["L4 generate_batch", *ratios(t, scale=1)]]))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attention_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--min-history", type=int, default=32)
    p.add_argument("--max-history", type=int, default=640)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hq", type=int, default=8)
    p.add_argument("--hkv", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of q, K and V (layer part)")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds; the median is reported")
    p.add_argument("--calls", type=int, default=20, help="run() calls per round")
    p.add_argument("--no-prefill", action="store_true", help="skip part 2 (the prefill cases)")
    p.add_argument("--threads-scaling", action="store_true",
                   help="also time the C++ kernel at 1 and 2 threads on every case, and print the ratio")
    p.add_argument("--engine", action="store_true", help="also time a whole L4 run on the embedded model")
    p.add_argument("--model", help="the --engine run's model: a checkpoint directory or a named model such as "
                   "smollm2 (default: the embedded model)")
    p.add_argument("--new-tokens", type=int, default=16, help="new tokens per request in the --engine run")
    p.add_argument("--engine-rounds", type=int, default=3)
    return p


def main() -> None:
    args = parser().parse_args()
    conditions = harness.start("cpu", args.dtype, code=["scripts/benchmark/attention_bench.py"])
    names = layer_runs(args)
    conditions.backend = ",".join(names)  # every backend timed, in the tables' order
    if args.threads_scaling:
        threads_scaling(args)
        conditions.extra["threads-scaling"] = "1 and 2"
    if args.engine:
        engine_run(args)
    harness.finish(conditions, console)


if __name__ == "__main__":
    main()

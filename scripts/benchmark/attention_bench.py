"""Time the CPU attention backends against each other, in one process, and print the ratios.

Part 1: one layer's `run` on a decode batch (random K/V in scattered pages): the torch oracle, the batched
backend and the C++ kernel (when it builds), timed in alternating rounds so a busy machine slows all alike,
beside the memory floor: the K/V bytes the batch reads over this machine's streaming-read rate, measured in
the same run. Part 2 (--engine): a whole L4 run on the embedded model with each backend, checking the tokens
are identical. Pin the thread count (OMP_NUM_THREADS=1) and report `uptime` beside the numbers: the ratios
are the claim, not the times.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.backends import BatchedBackend, TorchBackend
from lessons.l3_block_tensor.backends.cpp_backend import CppBackend, KernelUnavailable
from lessons.l3_block_tensor.batch_meta import BatchMeta

DRAM_BYTES = 1024**3  # a read this large comes from DRAM on any machine the course runs on (the box's L3: 480 MiB)


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
    return nbytes / alternate({"sum": lambda: x.sum()}, rounds=5, calls=3)["sum"]


def decode_batch(args: argparse.Namespace) -> tuple[BatchMeta, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`requests` decodes with histories evenly spread over min..max history, pages shuffled over the pool."""
    g = torch.Generator().manual_seed(0)
    step = (args.max_history - args.min_history) / max(1, args.requests - 1)
    histories = [round(args.min_history + i * step) for i in range(args.requests)]
    num_blocks = sum(-(-n // args.block_size) for n in histories)
    free = torch.randperm(num_blocks, generator=g).tolist()
    reqs = [Request(list(range(n)), args.block_size, blocks=[free.pop() for _ in range(-(-n // args.block_size))],
                    num_cached=n - 1) for n in histories]
    meta = BatchMeta.build(reqs, args.block_size, torch.device("cpu"))
    shape = (num_blocks, args.block_size, args.hkv, args.head_dim)
    dtype = getattr(torch, args.dtype)
    k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    return meta, torch.randn(args.requests, args.hq, args.head_dim, generator=g).to(dtype), k, v


def alternate(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each fn, measured in alternating rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up: first-call allocations and lazy init stay out of the numbers
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls)
    return {name: statistics.median(ts) for name, ts in times.items()}


def layer_run(args: argparse.Namespace) -> None:
    meta, q, k, v = decode_batch(args)
    backends = {name: cls() for name, cls in cpu_backends().items()}
    for b in backends.values():
        b.plan(meta)
    tol = 1e-5 if args.dtype == "float32" else 2e-2  # the tolerances of tests/test_l3_batched_backend.py
    want = backends["torch"].run(q, k, v, meta)
    for name, b in backends.items():
        torch.testing.assert_close(b.run(q, k, v, meta), want, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    t = alternate({name: (lambda b=b: b.run(q, k, v, meta)) for name, b in backends.items()}, args.rounds, args.calls)
    # What any kernel must read: every K and V row of each request's history, once.
    kv_tokens = int(meta.kv_last_page_len.sum()) + args.block_size * int((meta.kv_indptr.diff() - 1).sum())
    kv_bytes = 2 * kv_tokens * args.hkv * args.head_dim * k.element_size()
    rate, dram_rate = read_rate(kv_bytes), read_rate(DRAM_BYTES)
    floor = kv_bytes / rate
    print(f"one layer's run(): {args.requests} decodes, histories {args.min_history}..{args.max_history}, "
          f"S={args.block_size}, Hq={args.hq}, Hkv={args.hkv}, D={args.head_dim}, {args.dtype}, "
          f"{torch.get_num_threads()} thread(s)")
    for name, secs in t.items():
        print(f"  {name:8s} {secs * 1e3:8.3f} ms   {t['torch'] / secs:6.2f}x the oracle   "
              f"{t['batched'] / secs:6.2f}x batched   {floor / secs:6.1%} of the memory floor")
    print(f"  memory floor {floor * 1e3:.3f} ms: {kv_bytes / 2**20:.1f} MiB of K/V ({kv_tokens:,} tokens x {args.hkv} KV "
          f"heads x {args.head_dim} x {k.element_size()} B, K and V) read once, at the rate one sum reads "
          f"a buffer of that size ({rate / 1e9:.1f} GB/s, measured now, same threads); from DRAM (a 1 GiB sum, "
          f"{dram_rate / 1e9:.1f} GB/s) it would be {kv_bytes / dram_rate * 1e3:.3f} ms")


def engine_run(args: argparse.Namespace) -> None:
    from lessons.l4_continuous import L4Engine
    from shared.generation import StopRule
    from shared.model import Qwen3ForCausalLM
    from shared.tiny_qwen3 import default_model_dir

    model = Qwen3ForCausalLM.from_dir(default_model_dir(), torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    step = (args.max_history - args.min_history) / max(1, args.requests - 1)
    prompts = [torch.randint(0, 151_000, (round(args.min_history + i * step),), generator=g).tolist()
               for i in range(args.requests)]
    stop = StopRule(args.new_tokens, ignore_eos=True)
    # Room for every request at once: backpressure would change the batches the two backends see.
    num_blocks = sum(-(-(len(p) + args.new_tokens) // args.block_size) for p in prompts)
    out: dict[str, list[list[int]]] = {}

    def run(name: str) -> Callable[[], None]:
        def go() -> None:
            out[name] = L4Engine(model, args.block_size, num_blocks, backend=name).generate_batch(prompts, stop)
        return go

    t = alternate({name: run(name) for name in cpu_backends()}, rounds=args.engine_rounds, calls=1)
    assert all(tokens == out["torch"] for tokens in out.values()), "the backends disagree on the tokens"
    print(f"whole L4 run: embedded model, {args.requests} prompts of {args.min_history}..{args.max_history} tokens, "
          f"{args.new_tokens} new tokens each, S={args.block_size}: identical tokens")
    for name, secs in t.items():
        print(f"  {name:8s} {secs:8.3f} s    {t['torch'] / secs:6.2f}x the oracle   {t['batched'] / secs:6.2f}x batched")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--engine", action="store_true", help="also time a whole L4 run on the embedded model")
    p.add_argument("--new-tokens", type=int, default=16, help="new tokens per request in the --engine run")
    p.add_argument("--engine-rounds", type=int, default=3)
    args = p.parse_args()
    layer_run(args)
    if args.engine:
        engine_run(args)


if __name__ == "__main__":
    main()

"""What a preempted request costs to bring back: L5's swap (copy its blocks out and in) against recompute
(prefill its whole history again), for histories of several lengths, on the embedded tiny model.

    OMP_NUM_THREADS=1 python scripts/benchmark/swap_cost.py --threads 1

Each figure is the best of --repeats runs. On a CPU the "host" pool is just another CPU tensor, so a swap
is a memory copy; on a GPU it crosses PCIe and the balance shifts (docs/l5_preemption.md sizes it).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's lessons/ and shared/, not an installed course's
import harness  # noqa: E402
from lessons.l2_token_flat.request import Request  # noqa: E402
from lessons.l3_block_tensor.runner import PagedRunner  # noqa: E402
from lessons.l5_preemption.host_pool import HostKvPool  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402


def best_of(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def parser() -> OneLineParser:
    p = OneLineParser(prog="swap_cost.py", description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2000], help="history lengths to time")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    if min(args.tokens) < 1 or max(args.tokens) > 4096:
        p.error(f"--tokens must lie in 1..4096 (the tiny model's context), got {args.tokens}")
    if args.block_size < 1 or args.repeats < 1:
        p.error(f"--block-size and --repeats must be at least 1, got {args.block_size} and {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Qwen3ForCausalLM.from_dir(default_model_dir(), torch.float32, torch.device("cpu"))
    blocks = -(-max(args.tokens) // args.block_size)
    runner = PagedRunner(model, args.block_size, blocks, "torch")
    host = HostKvPool(runner.pool, blocks)
    conditions = harness.start("cpu", torch.float32, backend=harness.backend_name(runner))
    cells = []
    for n in args.tokens:
        def recompute() -> None:
            r = Request(list(range(1, n + 1)), args.block_size)
            r.reserve(n, runner.allocator)
            runner.forward([r])
            runner.allocator.free(r.blocks)

        used = list(range(-(-n // args.block_size)))
        prefill = best_of(args.repeats, recompute)
        swap = best_of(args.repeats, lambda: host.swap_in(host.swap_out(used), used))
        cells.append([str(n), f"{prefill * 1e3:.1f}", f"{swap * 1e3:.2f}", f"{prefill / swap:.0f}x"])
    console = Console(soft_wrap=True)
    console.print(harness.table("bring back a preempted request (tiny model), best of "
                                f"{args.repeats}", ("history tokens", "recompute (prefill) ms", "swap out + in ms",
                                                    "recompute / swap"), cells))
    harness.finish(conditions, console)


if __name__ == "__main__":
    main()

"""Draw the KV pool over time: one line per engine step, each request's blocks in its own letter and colour.

    python scripts/pool_timeline.py                     # L4 on the tiny model, a 32-block pool
    python scripts/pool_timeline.py --lesson l5 --policy swap

Requests arrive every --stagger steps; watch them join, grow a block every --block-size tokens, and leave.
Under L5 a request that disappears mid-run and comes back was preempted ("!" marks the step).
"""
from __future__ import annotations

import random
import string
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.text import Text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l4_continuous import Arrival, L4Engine  # noqa: E402
from lessons.l5_preemption import L5Engine  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.pool_trace import record_engine  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

COLOURS = ["red", "green", "yellow", "blue", "magenta", "cyan", "bright_red", "bright_green", "bright_blue", "bright_magenta"]


def main() -> None:
    p = OneLineParser(prog="pool_timeline.py", description=__doc__)
    p.add_argument("--lesson", choices=("l4", "l5"), default="l4")
    p.add_argument("--policy", choices=("recompute", "swap"), default="recompute")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=32)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--stagger", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="a checkpoint directory or a named model such as smollm2 (default: embedded)")
    p.add_argument("--trace", metavar="FILE", help="write the pool trace (JSON lines) here; "
                                                 "python scripts/pool_viewer.py --trace FILE draws it")
    args = p.parse_args()
    try:
        model_dir = resolve_model_dir(args.model, default_model_dir)
    except CourseError as e:
        p.error(str(e))
    model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
    rng = random.Random(args.seed)
    top = min(model.config.vocab_size, 100000)
    work = [Arrival([rng.randrange(1000, top) for _ in range(rng.randint(4, 40))], StopRule(rng.randint(4, 40)),
                    step=args.stagger * i) for i in range(args.requests)]
    kw = {"policy": args.policy} if args.lesson == "l5" else {}
    engine = (L5Engine if args.lesson == "l5" else L4Engine)(model, args.block_size, args.num_blocks, backend="torch", **kw)
    preempted_at: set[int] = set()
    step = engine.step

    def watched_step():
        before = engine.stats.preemptions
        out = step()
        if engine.stats.preemptions > before:
            preempted_at.add(engine.stats.steps)
        return out

    engine.step = watched_step
    with record_engine(engine, args.trace, args.lesson):
        engine.run(work)
    draw(Console(width=120), engine, args, preempted_at)


def draw(console: Console, engine: L4Engine, args, preempted_at: set[int]) -> None:
    n = engine.allocator.num_blocks
    console.print(f"[bold]{args.lesson.upper()}[/] pool of {n} blocks x {args.block_size} tokens; "
                  f"letters = requests (A arrives first), · = free block")
    for i, held in enumerate(engine.stats.timeline, start=1):
        line = Text(f"{i:4d} ")
        for seq_id, blocks in held.items():
            line.append(string.ascii_uppercase[seq_id % 26] * blocks, style=COLOURS[seq_id % len(COLOURS)])
        line.append("·" * (n - sum(held.values())), style="dim")
        line.append(f" {len(held):2d} running" + ("  ! preempted" if i in preempted_at else ""))
        console.print(line)
    s = engine.stats
    console.print(f"{s.steps} steps, peak {s.peak_running} running, KV utilization {s.utilization_mean:.1%} mean, "
                  f"{s.preemptions} preemption(s), {s.swaps_out} swap(s) out")


if __name__ == "__main__":
    main()

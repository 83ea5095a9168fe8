"""How many requests run at once in a fixed KV budget: max-length reservation versus paged blocks.

Which requests run when depends only on lengths (the workload is greedy with EOS ignored, so every
output length is fixed), not on token values. So the paged rows drive the real L4 / L5 schedulers with a
no-op runner that only marks tokens as cached: the exact schedule, in a second, without the model.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from rich.console import Console

import bench_systems as bs
from harness import table
from lessons.l2_token_flat.block_allocator import BlockAllocator
from lessons.l4_continuous import L4Engine
from lessons.l4_continuous.scheduler import Scheduler
from lessons.l5_preemption import L5Engine
from shared.config import Qwen3Config


class NoOpRunner:
    """The PagedRunner interface without a model: feeds nothing, caches everything, logits of one token."""

    def __init__(self, block_size: int, num_blocks: int):
        self.block_size, self.allocator = block_size, BlockAllocator(num_blocks)
        shape = (num_blocks, block_size, 1, 1)  # a token-sized stand-in, so L5's swap copies have a pool to copy
        self.pool = SimpleNamespace(k=[torch.zeros(shape)], v=[torch.zeros(shape)])

    def forward(self, requests) -> torch.Tensor:
        for r in requests:
            r.num_cached = r.num_tokens
        return torch.zeros(len(requests), 1)


class ReservingScheduler(Scheduler):
    """L1-style admission: every running request holds `reserve_blocks` of KV, whatever its real length."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_running: int, reserve_blocks: int):
        super().__init__(allocator, block_size, max_running)
        self.reserve_blocks = reserve_blocks

    def can_admit(self, seq) -> bool:
        return (len(self.running) + 1) * self.reserve_blocks <= self.allocator.num_blocks


class ReservingEngine(L4Engine):
    def __init__(self, *args, reserve_tokens: int, **kw):
        self.reserve_tokens = reserve_tokens
        super().__init__(*args, **kw)

    def make_scheduler(self, max_running: int) -> Scheduler:
        reserve_blocks = -(-self.reserve_tokens // self.block_size)
        return ReservingScheduler(self.allocator, self.block_size, max_running, reserve_blocks)


def simulate(cls, jobs, block_size: int, num_blocks: int, max_running: int, **kw):
    # Only the sizes matter; the vocabulary is Qwen3's, so the engine's token-id check accepts the workload.
    cfg = Qwen3Config(151_936, 1, 1, 1, 1, 1, 1, 1e-6, 1e6, 1 << 20, True, ())
    model = SimpleNamespace(config=cfg, lm_head=SimpleNamespace(weight=torch.zeros(1)))
    engine = cls(model, block_size, num_blocks, max_running, runner=NoOpRunner(block_size, num_blocks), **kw)
    engine.stats.record_timeline = False
    for j in jobs:
        engine.add_request(j.prompt_ids, bs.stop_for(j))
    while engine.scheduler.has_work():
        engine.step()
    return engine.stats


def budget_rows(console: Console, budget: int, args, context: int = 4096) -> list[dict]:
    jobs = bs.make_workload(args.requests, tuple(args.prompt_len), tuple(args.new_tokens), 1000, args.seed)
    # The exact-max baseline: a server that knew each request's real maximum reserves the longest one's
    # length for all (not the MIN/MAX bound of the options, which no request may reach).
    longest = max(len(j.prompt_ids) + j.new_tokens for j in jobs)
    blocks = budget // args.block_size
    rows = []
    for name, cls, kw in ((f"max-length reservation ({context} = model context)", ReservingEngine, {"reserve_tokens": context}),
                          (f"max-length reservation ({longest} = workload's longest request)", ReservingEngine, {"reserve_tokens": longest}),
                          ("L4 paged, admit on promise", L4Engine, {}),
                          ("L5 paged, admit on need (recompute)", L5Engine, {"policy": "recompute"})):
        if cls is ReservingEngine and kw["reserve_tokens"] > budget:
            rows.append({"scheme": name, "peak": 0, "mean": 0.0, "util_mean": 0.0, "preemptions": 0})
            continue  # not even one request fits
        s = simulate(cls, jobs, args.block_size, blocks, args.max_running, **kw)
        held = sum(s.tokens_held) / max(1, sum(s.running))  # tokens a running request really holds, on average
        util = s.utilization_mean if cls is not ReservingEngine else held / kw["reserve_tokens"]
        rows.append({"scheme": name, "peak": s.peak_running, "mean": sum(s.running) / len(s.running),
                     "util_mean": util, "preemptions": s.preemptions})
    base = rows[1]["mean"] or 1.0
    for r in rows:
        r["x_vs_longest"] = r["mean"] / base
    console.print(table(f"KV budget {budget} tokens ({blocks} blocks of {args.block_size}), {len(jobs)} requests, "
                        f"max-running {args.max_running}",
                        ("scheme", "peak concurrent", "mean concurrent", f"x reservation ({longest})", "KV util",
                         "preemptions"),
                        [[r["scheme"], str(r["peak"]), f"{r['mean']:.1f}", f"{r['x_vs_longest']:.2f}x",
                          f"{r['util_mean']:.1%}", str(r["preemptions"])] for r in rows]))
    return rows

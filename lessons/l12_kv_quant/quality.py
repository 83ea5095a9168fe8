"""The quality contract: how far a quantized pool moves the next-token distribution, teacher-forced.

Exact tokens are no longer the test: int8 K/V perturb every attention a little, and on a near-tie that is
enough to flip a greedy choice, after which two runs generate different texts and every later position
differs for that reason alone. So both runs read the same token stream (teacher forcing), and at every
position we compare the two distributions over the next token, as llama.cpp's perplexity tool does:
  KL(P_ref || P_test)  mean and 99.9th percentile over every position
  top-1 agreement      the share of positions whose argmax is the same
The yardstick is the error the course already accepts: the same figures for the model computed in bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l3_block_tensor.runner import PagedRunner

CHUNK = 128  # positions per forward: a chunk's logits are CHUNK x vocab floats (78 MB at Qwen3's vocabulary)


@dataclass(frozen=True)
class Worst:
    """The position with the largest KL, and each side's top token there."""

    stream: int
    position: int
    kl: float
    ref_top: int
    test_top: int


@dataclass(frozen=True)
class Quality:
    positions: int
    mean_kl: float
    p999_kl: float
    top1: float  # share of positions with the same argmax
    worst: Worst

    def line(self) -> str:
        return (f"KL mean {self.mean_kl:.3g}, p99.9 {self.p999_kl:.3g}, top-1 agreement {self.top1:.2%} "
                f"over {self.positions:,} positions")


def teacher_forced_logits(runner: PagedRunner, stream: list[int]):
    """fp32 logits [rows, vocab] at every position of `stream`, CHUNK rows at a time, each chunk attending over
    the pool's pages of everything before it (so later chunks read what earlier ones wrote, as decodes do).
    Yields the chunks in order; the blocks go back to the runner's allocator at the end."""
    s = runner.block_size
    blocks = runner.allocator.alloc(-(-len(stream) // s))
    try:
        for start in range(0, len(stream), CHUNK):
            end = min(start + CHUNK, len(stream))
            req = Request(stream[:end], s, blocks=blocks, num_cached=start)
            meta = BatchMeta.build([req], s, runner.device)
            runner.backend.plan(meta)
            tokens = torch.tensor(stream[start:end], device=runner.device)
            hidden = runner.model(tokens, meta.positions, runner, meta)
            yield runner.model.logits(hidden).float()
    finally:
        runner.allocator.free(blocks)


def compare(ref: PagedRunner, tests: dict[str, PagedRunner], streams: list[list[int]]) -> dict[str, Quality]:
    """Every runner over the same streams (the reference computed once); the distributions compared with the
    reference's at every position. Returns each test runner's Quality, by name."""
    kls: dict[str, list[torch.Tensor]] = {name: [] for name in tests}
    agree = dict.fromkeys(tests, 0)
    worst = dict.fromkeys(tests, Worst(0, 0, -1.0, 0, 0))
    for i, stream in enumerate(streams):
        pos = 0
        chunks = zip(teacher_forced_logits(ref, stream), *(teacher_forced_logits(r, stream) for r in tests.values()))
        for a, *others in chunks:
            # fp64: on near-uniform distributions (HF-initialised checkpoints) every KL is about 1e-6, below what
            # fp32's log-probabilities (about 12 in size) resolve
            log_p = torch.log_softmax(a.double(), -1)
            p = log_p.exp()  # once per chunk, shared by every runner compared
            top_a = a.argmax(-1)
            for name, b in zip(tests, others):
                # sum p (log p - log q), in place: a chunk's fp64 rows are 155 MB at Qwen3's vocabulary
                kl = torch.log_softmax(b.double(), -1).neg_().add_(log_p).mul_(p).sum(-1).clamp_min(0)  # [rows]
                top_b = b.argmax(-1)
                agree[name] += int((top_a == top_b).sum())
                j = int(kl.argmax())
                if float(kl[j]) > worst[name].kl:
                    worst[name] = Worst(i, pos + j, float(kl[j]), int(top_a[j]), int(top_b[j]))
                kls[name].append(kl)
            pos += a.shape[0]
    out = {}
    for name in tests:
        all_kl = torch.cat(kls[name])
        out[name] = Quality(positions=all_kl.numel(), mean_kl=float(all_kl.mean()),
                            p999_kl=float(torch.quantile(all_kl, 0.999)), top1=agree[name] / all_kl.numel(),
                            worst=worst[name])
    return out


def holds(test: Quality, yardstick: Quality) -> bool:
    """The contract: the quantized pool moves the distributions no more than bf16 compute does, by all three
    measures (mean KL, its 99.9th percentile, top-1 agreement)."""
    return test.mean_kl <= yardstick.mean_kl and test.p999_kl <= yardstick.p999_kl and test.top1 >= yardstick.top1

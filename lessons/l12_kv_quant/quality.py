"""The quality contract: how far a quantized pool moves the next-token distribution, teacher-forced.

Exact tokens are no longer the test: int8 K/V perturb every attention a little, and on a near-tie that is
enough to flip a greedy choice, after which two runs generate different texts and every later position
differs for that reason alone. So both runs read the same token stream (teacher forcing), and at every
position we compare the two distributions over the next token, as llama.cpp's perplexity tool does:
  KL(P_ref || P_test)  mean and tail (99th, 99.9th percentile) over every position, prompts included
  top-1 agreement      the share of positions whose argmax is the same
The yardstick is the error the course already accepts: the same figures for the model computed in bf16.

Judging "no worse than the yardstick" is statistics, not a comparison of two numbers: both runs are samples,
and a tail percentile of a thousand positions is the largest value or two. `judge` compares the two runs
position by position (they read the same streams) with a paired block bootstrap: blocks of BLOCK neighbouring
positions (whose errors are correlated) drawn with replacement, the same draw for both runs, RESAMPLES times,
seeded. It is a non-inferiority test with stated margins: the test may be worse than the yardstick by at most
KL_MARGIN (a ratio, for the KLs) and TOP1_MARGIN (for top-1 agreement). A measure "holds" when its 95% interval
(test / yardstick for the KLs, test - yardstick for top-1) lies wholly within the margin; "fails" when it lies
wholly beyond it; "unresolved" when it straddles the margin (more positions narrow the interval).
The tails judged are the percentiles the sample resolves, each with at least MIN_TAIL positions beyond
it: p99 from 5,000 positions, p99.9 too from 50,000; below 5,000 positions no tail is judged (it is still
printed). With fewer, the tail's interval is wider than the whole margin and its verdict is noise.
The contract holds when every judged measure holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l3_block_tensor.runner import PagedRunner

CHUNK = 128  # positions per forward: a chunk's logits are CHUNK x vocab floats (78 MB at Qwen3's vocabulary)
BLOCK = 16  # positions resampled together: neighbouring positions share most of their context
RESAMPLES = 2000  # bootstrap draws: the 2.5% and 97.5% points each rest on 50 of them
# Positions a judged percentile must leave above it. At 10 (p99 of about 1,000 positions) the p99's interval
# spanned 0.18-0.85x, 0.51-1.51x and 0.74-2.11x (embedded model; SmolLM2 on two CPUs, whose bf16 yardsticks
# differ): a factor of three or more, so which CPU rounded the yardstick decided the verdict. The interval
# narrows about as 1/sqrt(tail) (a held-out checkpoint's: 0.81-1.32x at 10, 0.83-1.06x at 36), so at 50 it is
# well under half as wide, within the margin's size.
MIN_TAIL = 50
KL_MARGIN = 1.25  # the test's KL (mean, tail) may be up to 1.25x the yardstick's
TOP1_MARGIN = 0.01  # its top-1 agreement up to 1 percentage point below


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
    kl: torch.Tensor | None = field(default=None, repr=False, compare=False)  # fp64 [positions], streams in order
    agree: torch.Tensor | None = field(default=None, repr=False, compare=False)  # bool [positions]
    stream_lengths: tuple[int, ...] = ()

    @property
    def p99_kl(self) -> float:
        return float(torch.quantile(self.kl, 0.99))

    def line(self) -> str:
        return (f"KL mean {self.mean_kl:.3g}, p99 {self.p99_kl:.3g}, p99.9 {self.p999_kl:.3g}, top-1 agreement "
                f"{self.top1:.2%} over {self.positions:,} positions")


# Task L12.6: teacher-forced: every runner over the same streams, KL(P_ref || P_test) and top-1 at every position
def kl_rows(ref_logits: torch.Tensor, test_logits: torch.Tensor,
            ref_log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """KL(P_ref || P_test) per row, in fp64 (on near-uniform distributions every KL is about 1e-6, below what
    fp32's log-probabilities, about 12 in size, resolve): sum over the vocabulary of p_ref (log p_ref - log p_test).
    `ref_log_probs`: log_softmax(ref_logits) in fp64, when the caller has it (compare: once a chunk for all runners)."""
    log_p = torch.log_softmax(ref_logits.double(), -1) if ref_log_probs is None else ref_log_probs
    return torch.log_softmax(test_logits.double(), -1).neg_().add_(log_p).mul_(log_p.exp()).sum(-1).clamp_min(0)


# Task L12.6: teacher-forced: every runner over the same streams, KL(P_ref || P_test) and top-1 at every position
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


# Task L12.6: teacher-forced: every runner over the same streams, KL(P_ref || P_test) and top-1 at every position
def compare(ref: PagedRunner, tests: dict[str, PagedRunner], streams: list[list[int]]) -> dict[str, Quality]:
    """Every runner over the same streams (the reference computed once); the distributions compared with the
    reference's at every position. Returns each test runner's Quality, by name."""
    kls: dict[str, list[torch.Tensor]] = {name: [] for name in tests}
    agree: dict[str, list[torch.Tensor]] = {name: [] for name in tests}
    worst = dict.fromkeys(tests, Worst(0, 0, -1.0, 0, 0))
    for i, stream in enumerate(streams):
        pos = 0
        chunks = zip(teacher_forced_logits(ref, stream), *(teacher_forced_logits(r, stream) for r in tests.values()))
        for a, *others in chunks:
            top_a, log_p = a.argmax(-1), torch.log_softmax(a.double(), -1)
            for name, b in zip(tests, others):
                kl = kl_rows(a, b, log_p)  # [rows]
                top_b = b.argmax(-1)
                agree[name].append(top_a == top_b)
                j = int(kl.argmax())
                if float(kl[j]) > worst[name].kl:
                    worst[name] = Worst(i, pos + j, float(kl[j]), int(top_a[j]), int(top_b[j]))
                kls[name].append(kl)
            pos += a.shape[0]
    out = {}
    for name in tests:
        all_kl, same = torch.cat(kls[name]), torch.cat(agree[name])
        out[name] = Quality(positions=all_kl.numel(), mean_kl=float(all_kl.mean()),
                            p999_kl=float(torch.quantile(all_kl, 0.999)), top1=float(same.double().mean()),
                            worst=worst[name], kl=all_kl, agree=same, stream_lengths=tuple(map(len, streams)))
    return out


@dataclass(frozen=True)
class Measure:
    """One measure of the contract: both runs' values and the 95% interval of test against yardstick (a ratio for
    the KLs, a difference in percentage points for top-1)."""

    name: str
    test: float
    yardstick: float
    low: float
    high: float
    verdict: str  # "holds" | "fails" | "unresolved"

    def line(self) -> str:
        if self.name.startswith("top-1"):
            return (f"{self.name} {self.test:.2%} vs {self.yardstick:.2%}: {100 * (self.test - self.yardstick):+.2f} "
                    f"points [{100 * self.low:+.2f}, {100 * self.high:+.2f}] {self.verdict}")
        return (f"{self.name} {self.test:.3g} vs {self.yardstick:.3g}: {self.test / self.yardstick:.2f}x "
                f"[{self.low:.2f}, {self.high:.2f}] {self.verdict}")


@dataclass(frozen=True)
class Judgement:
    positions: int
    measures: tuple[Measure, ...]
    tail_note: str  # why no higher percentile is judged ("" when p99.9 is)

    @property
    def holds(self) -> bool:
        return all(m.verdict == "holds" for m in self.measures)

    def line(self) -> str:
        return "; ".join(m.line() for m in self.measures)


# Task L12.7: judge test against yardstick, paired block bootstrap: a 95% interval and a verdict per measure
def tail_quantiles(positions: int) -> list[float]:
    """The percentiles with MIN_TAIL positions beyond them: p99 from 5,000 positions, p99.9 too from 50,000."""
    return [q for q in (0.99, 0.999) if positions * (1 - q) >= MIN_TAIL - 1e-9]


# Task L12.7: judge test against yardstick, paired block bootstrap: a 95% interval and a verdict per measure
def judge(test: Quality, yardstick: Quality, seed: int = 0) -> Judgement:
    """The contract, judged paired: the same positions, the same bootstrap draws for both runs (see the module's
    docstring). Deterministic for a seed."""
    n = test.positions
    if yardstick.positions != n or test.stream_lengths != yardstick.stream_lengths:
        raise ValueError("the two runs must read the same streams")
    # block ids, never crossing a stream's end
    ids, first = [], 0
    for length in test.stream_lengths:
        ids += [first + i // BLOCK for i in range(length)]
        first += -(-length // BLOCK)
    block_of = torch.tensor(ids)
    draws = torch.randint(first, (RESAMPLES, first), generator=torch.Generator().manual_seed(seed))
    counts = torch.zeros(RESAMPLES, first, dtype=torch.float64).scatter_add_(1, draws, torch.ones_like(draws,
                                                                                              dtype=torch.float64))
    weights = counts[:, block_of]  # [RESAMPLES, positions]: how often each position is drawn
    total = weights.sum(1)

    def means(x: torch.Tensor) -> torch.Tensor:
        return weights @ x.double() / total

    def quantiles(x: torch.Tensor, q: float) -> torch.Tensor:
        values, order = x.double().sort()
        cum = weights[:, order].cumsum(1)
        return values[torch.searchsorted(cum, (q * total).unsqueeze(1)).clamp_max(n - 1).squeeze(1)]

    def interval(samples: torch.Tensor) -> tuple[float, float]:
        low, high = torch.quantile(samples, torch.tensor([0.025, 0.975], dtype=samples.dtype)).tolist()
        return low, high

    def ratio(name: str, t: float, y: float, t_draws: torch.Tensor, y_draws: torch.Tensor) -> Measure:
        low, high = interval(t_draws / y_draws)
        return Measure(name, t, y, low, high,
                       "holds" if high <= KL_MARGIN else "fails" if low > KL_MARGIN else "unresolved")

    measures = [ratio("mean KL", test.mean_kl, yardstick.mean_kl, means(test.kl), means(yardstick.kl))]
    tails = tail_quantiles(n)
    for q in tails:
        t, y = float(torch.quantile(test.kl, q)), float(torch.quantile(yardstick.kl, q))
        measures.append(ratio(f"p{100 * q:g} KL", t, y, quantiles(test.kl, q), quantiles(yardstick.kl, q)))
    low, high = interval(means(test.agree) - means(yardstick.agree))
    measures.append(Measure("top-1 agreement", test.top1, yardstick.top1, low, high,
                            "holds" if low >= -TOP1_MARGIN else "fails" if high < -TOP1_MARGIN else "unresolved"))
    note = ("" if len(tails) == 2 else
            f"p99.9 not judged: {n:,} positions leave {n * 0.001:.1f} beyond it (needs {MIN_TAIL})" if tails else
            f"no tail judged: {n:,} positions leave {n * 0.01:.1f} beyond p99 (needs {MIN_TAIL})")
    return Judgement(n, tuple(measures), note)


def holds(test: Quality, yardstick: Quality) -> bool:
    """The contract: the quantized pool is shown to move the distributions no more than bf16 compute does, within
    the margins, by every judged measure (mean KL, the resolved tail, top-1 agreement)."""
    return judge(test, yardstick).holds

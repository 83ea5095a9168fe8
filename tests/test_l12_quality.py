"""L12's quality contract, measured: int8 KV moves the next-token distribution no more than bf16 compute does.

quality.compare runs three runners teacher-forced over the same token streams (each prompt, then the fp32
engine's greedy continuation of it): the fp32 model over fp32 pages (the reference), the fp32 model over int8
pages (the test), the model loaded in bf16 (the yardstick). judge() compares test and yardstick position by
position with a paired block bootstrap, a non-inferiority test with stated margins on every measure the sample
resolves: mean KL, the tail (p99 from 5,000 positions, p99.9 from 50,000), top-1 agreement; holds() is its verdict.

- The embedded model, 1,011 positions (the shared prompts + 225 greedy tokens each): the contract holds.
- The contract can fail: a pool that rounds to 4 bits (codes -7 .. 7, the same rows and kernel) is measured on
  the same streams and does not hold. Without this, a holds() that always said yes would pass every test.
- The held-out shapes (conftest's other_checkpoints: untied embeddings; GQA 4:1 with head_dim 128), 251
  positions each (the prompts + 35 tokens each; fewer because compare's KL arithmetic over a 151,936-token
  vocabulary costs about 9 ms per position for each runner compared, beside 2 ms for its logits): too few for
  a tail, so mean KL and top-1 are judged there (test_held_out_shapes).
- What is measured is what the doc says: KL(P_ref || P_test), not the reverse, averaged over every position of
  every stream (prompts included); judge()'s verdicts on made-up runs whose answer is known.

Every fixture is module-scoped: the file's cost is the teacher-forced forwards and the KL arithmetic, once.
"""
from __future__ import annotations

import pytest
import torch

from lessons.l2_token_flat.engine import blocks_for
from lessons.l3_block_tensor.runner import PagedRunner
from lessons.l4_continuous.engine import Arrival
from lessons.l12_kv_quant import L12Engine
from lessons.l12_kv_quant.kv_pool import Int8KvPool
from lessons.l12_kv_quant.quality import (KL_MARGIN, Quality, Worst, compare, holds, judge, kl_rows,
                                          tail_quantiles)
from lessons.l12_kv_quant.quantize import SCALE_BYTES
from lessons.l12_kv_quant.runner import quantized
from shared.generation import StopRule
from shared.model import Qwen3ForCausalLM

# Slow: the tests that measure (the quality contract teacher-forced over about a thousand positions, five
# checkpoints), each marked; the checks of kl_rows and judge on made-up numbers take a second.
slow = pytest.mark.slow

CPU = torch.device("cpu")
BLOCK = 16
EMBEDDED_NEW = 225  # 4 prompts (111 tokens) + 4 x 225 = 1,011 positions
HELD_OUT_NEW = 35  # 111 + 4 x 35 = 251 positions per held-out shape


class FourBitKvPool(Int8KvPool):
    """A deliberately bad quantizer: the same packed rows (codes, then the fp32 scale), but scale = max|x| / 7,
    so codes are -7 .. 7: 4 bits' worth, each value off by up to 1/14 of the row's largest instead of 1/254."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        row = k.shape[2] + SCALE_BYTES
        self.k[layer].view(-1, k.shape[1], row)[slot_mapping] = pack_4bit(k)
        self.v[layer].view(-1, v.shape[1], row)[slot_mapping] = pack_4bit(v)


def pack_4bit(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    scales = x.abs().amax(dim=-1, keepdim=True) / 7
    codes = torch.round(x / torch.where(scales > 0, scales, 1.0)).clamp_(-7, 7).to(torch.int8)
    return torch.cat([codes, scales.view(torch.int8)], dim=-1)


class FourBitPagedRunner(quantized(PagedRunner, "int8")):
    def make_pool(self, cfg, num_blocks: int, block_size: int, dtype: torch.dtype) -> Int8KvPool:
        return FourBitKvPool(cfg, num_blocks, block_size, self.device)


def streams_of(model: Qwen3ForCausalLM, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Each prompt, then `new` greedy tokens of the fp32 engine (kv-dtype auto), EOS ignored."""
    engine = L12Engine(model, BLOCK, None, backend="auto", kv_dtype="auto")
    tails = engine.run([Arrival(p, StopRule(new, frozenset(), ignore_eos=True)) for p in prompts])
    return [p + t for p, t in zip(prompts, tails)]


def measure(fp32: Qwen3ForCausalLM, bf16: Qwen3ForCausalLM, streams: list[list[int]],
            bad: bool = False) -> dict[str, Quality]:
    n = blocks_for(max(map(len, streams)), BLOCK)
    tests = {"int8": quantized(PagedRunner, "int8")(fp32, BLOCK, n), "bf16": PagedRunner(bf16, BLOCK, n)}
    if bad:
        tests["4-bit"] = FourBitPagedRunner(fp32, BLOCK, n)
    runners = [*tests.values()]
    assert type(runners[0].pool) is Int8KvPool and runners[1].pool.k[0].dtype == torch.bfloat16
    results = compare(PagedRunner(fp32, BLOCK, n), tests, streams)
    for r in runners:
        assert r.allocator.num_free == n, "compare gave every block back"
    return results


@pytest.fixture(scope="module")
def embedded(tiny_model, tiny_dir, prompt_ids) -> tuple[list[list[int]], dict[str, Quality]]:
    streams = streams_of(tiny_model, prompt_ids, EMBEDDED_NEW)
    bf16 = Qwen3ForCausalLM.from_dir(tiny_dir, torch.bfloat16, CPU)
    return streams, measure(tiny_model, bf16, streams, bad=True)


@slow
def test_the_contract_holds_on_the_embedded_model(embedded):
    streams, q = embedded
    int8, bf16 = q["int8"], q["bf16"]
    assert int8.positions == bf16.positions == sum(map(len, streams)) >= 1000
    assert holds(int8, bf16), f"int8: {int8.line()}; bf16: {bf16.line()}"
    # Not a vacuous pass: both runners moved the distributions (a test runner that was secretly the
    # reference would score KL 0 and top-1 100%), and int8 by a margin, not a hair. Measured int8 / bf16: mean KL
    # 0.61x, p99.9 0.51x (Intel Xeon AMX), 0.60x and 0.48x (torch capped to AVX2; bf16's KL moves with the CPU):
    # 1.3x and 1.6x under 0.8.
    assert 0 < int8.mean_kl < 0.8 * bf16.mean_kl and int8.p999_kl < 0.8 * bf16.p999_kl
    assert bf16.top1 < int8.top1 < 1
    w = int8.worst
    assert 0 <= w.stream < len(streams) and 0 <= w.position < len(streams[w.stream]) and w.kl >= int8.p999_kl


@slow
def test_a_bad_quantizer_fails_the_contract(embedded):
    """4-bit codes in the same rows, read by the same kernel: every measure worse than bf16's, and holds() says so."""
    _, q = embedded
    bad, bf16 = q["4-bit"], q["bf16"]
    assert not holds(bad, bf16), f"4-bit: {bad.line()}; bf16: {bf16.line()}"
    assert bad.mean_kl > bf16.mean_kl and bad.p999_kl > bf16.p999_kl and bad.top1 < bf16.top1


@slow
@pytest.mark.parametrize("name", ["untied", "gqa4_d128"])
def test_held_out_shapes(other_checkpoints, prompt_ids, name):
    """Two shapes unlike the embedded model's, built by transformers' own init (conftest), 251 positions each: no
    tail is judged (251 positions leave 2.5 beyond p99), the mean KL holds, and top-1 never fails (at 251
    positions one disagreement is 0.4 points, so a 1-point margin can be left unresolved: gqa4_d128 has one
    disagreement on each side, interval [-1.29, +1.12]). HF's init gives near-uniform distributions (every KL about 1e-6, rounding-sized); their p99.9,
    compared as two numbers, used to flip either way here (it is the largest value or two). When a p99 was judged
    from 1,000 positions (10 beyond it), gqa4_d128's was unresolved at 1,021 ([0.81, 1.32] against the 1.25x margin)
    and held at 3,661 ([0.83, 1.06]), as docs/l12_kv_quant_appendix.md records; it is judged from 5,000 now."""
    model_dir = other_checkpoints[name]
    fp32 = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, CPU)
    bf16 = Qwen3ForCausalLM.from_dir(model_dir, torch.bfloat16, CPU)
    streams = streams_of(fp32, prompt_ids, HELD_OUT_NEW)
    q = measure(fp32, bf16, streams)
    int8, yard = q["int8"], q["bf16"]
    verdict = judge(int8, yard)
    lines = f"int8: {int8.line()}; bf16: {yard.line()}; {verdict.line()}"
    assert int8.positions == sum(map(len, streams)) > 250
    assert [m.name for m in verdict.measures] == ["mean KL", "top-1 agreement"], lines
    assert verdict.measures[0].verdict == "holds" and verdict.measures[1].verdict != "fails", lines
    assert 0 < int8.mean_kl <= yard.mean_kl, lines


# --- what is measured, and how it is judged ----------------------------------------------------------------------


@pytest.mark.task("L12.6")
def test_kl_is_reference_to_test_per_row():
    """kl_rows (what compare sums) is KL(P_ref || P_test) = sum p_ref log(p_ref / p_test), the direction llama.cpp's
    tool and the doc use. Rows chosen so that the two directions differ by 2x."""
    ref = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, -2.0]])
    test = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    p, q = ref.double().softmax(-1), test.double().softmax(-1)
    forward, backward = (p * (p / q).log()).sum(-1), (q * (q / p).log()).sum(-1)
    assert not torch.allclose(forward, backward, rtol=0.1), "the premise: the directions differ"
    assert torch.allclose(kl_rows(ref, test), forward, rtol=1e-9, atol=1e-12), (kl_rows(ref, test), forward)


@slow
def test_the_mean_is_over_every_position_of_every_stream(embedded):
    """The Quality's KL has one value per position of every stream, prompts included, in stream order, and its
    mean_kl is their plain mean (not a mean of per-stream means, not the continuations only)."""
    streams, q = embedded
    int8 = q["int8"]
    assert int8.kl.shape == (sum(map(len, streams)),) and int8.stream_lengths == tuple(map(len, streams))
    assert int8.mean_kl == pytest.approx(float(int8.kl.mean()), rel=1e-12)
    per_stream = torch.stack([part.mean() for part in int8.kl.split(list(map(len, streams)))]).mean()
    assert abs(float(per_stream) - int8.mean_kl) > 1e-6 * int8.mean_kl, "the premise: the two means differ here"
    assert int8.top1 == pytest.approx(float(int8.agree.double().mean()))


def runs(kl_test: torch.Tensor, kl_yard: torch.Tensor, agree_test, agree_yard, lengths) -> tuple[Quality, Quality]:
    def quality(kl, agree):
        return Quality(kl.numel(), float(kl.mean()), float(torch.quantile(kl, 0.999)), float(agree.double().mean()),
                       Worst(0, 0, 0.0, 0, 0), kl, agree, tuple(lengths))
    return quality(kl_test, agree_test), quality(kl_yard, agree_yard)


@pytest.mark.task("L12.7")
def test_judge_verdicts_on_runs_with_a_known_answer():
    """Made-up runs, 6,000 positions (p99 judged): equal runs hold (margin), 2x the KL fails, 1.2x with noise at 200
    positions is unresolved on the mean; the same seed gives the same intervals."""
    g = torch.Generator().manual_seed(3)
    yard = torch.rand(6000, generator=g, dtype=torch.float64) * 0.1
    agree = torch.rand(6000, generator=g) < 0.9
    same = judge(*runs(yard.clone(), yard, agree, agree, [1500] * 4))
    assert same.holds and [m.name for m in same.measures] == ["mean KL", "p99 KL", "top-1 agreement"], same.line()
    # paired: every resample draws the same positions for both runs, so equal runs give exactly 1x (0 points)
    assert [(m.low, m.high) for m in same.measures] == [(1.0, 1.0), (1.0, 1.0), (0.0, 0.0)], same.line()
    worse = judge(*runs(2 * yard, yard, agree, agree, [1500] * 4))
    assert [m.verdict for m in worse.measures] == ["fails", "fails", "holds"], worse.line()
    noisy = yard[:200] * (1.2 + 0.8 * torch.randn(200, generator=g, dtype=torch.float64)).abs()
    small = judge(*runs(noisy, yard[:200], agree[:200], agree[:200], [200]))
    assert small.measures[0].verdict == "unresolved" and small.measures[0].low < KL_MARGIN < small.measures[0].high
    assert [m.name for m in small.measures] == ["mean KL", "top-1 agreement"] and "no tail judged" in small.tail_note
    assert judge(*runs(2 * yard, yard, agree, agree, [1500] * 4)) == worse, "not deterministic"
    fewer = agree & (torch.rand(6000, generator=g) < 0.9)  # about 9 points fewer agreements
    assert judge(*runs(yard, yard, fewer, agree, [1500] * 4)).measures[-1].verdict == "fails"


@pytest.mark.task("L12.7")
def test_the_judged_tail_is_the_one_the_sample_resolves():
    """A percentile is judged with 50 positions beyond it (quality.MIN_TAIL): at 10, its interval was wider than
    the margin by a factor of three or more, and the CPU that rounded the bf16 yardstick decided the verdict."""
    assert [tail_quantiles(n) for n in (1000, 4999, 5000, 49_999, 50_000)] == [
        [], [], [0.99], [0.99], [0.99, 0.999]]

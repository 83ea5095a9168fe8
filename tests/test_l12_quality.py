"""L12's quality contract, measured: int8 KV moves the next-token distribution no more than bf16 compute does.

quality.compare runs three runners teacher-forced over the same token streams (each prompt, then the fp32
engine's greedy continuation of it): the fp32 model over fp32 pages (the reference), the fp32 model over int8
pages (the test), the model loaded in bf16 (the yardstick). holds() asks all three measures at once: mean KL,
its 99.9th percentile, top-1 agreement.

- The embedded model, 1,011 positions (the shared prompts + 225 greedy tokens each): the contract holds.
- The contract can fail: a pool that rounds to 4 bits (codes -7 .. 7, the same rows and kernel) is measured on
  the same streams and does not hold. Without this, a holds() that always said yes would pass every test.
- The held-out shapes (conftest's other_checkpoints: untied embeddings; GQA 4:1 with head_dim 128), 251
  positions each (the prompts + 35 tokens each; fewer because compare's KL arithmetic over a 151,936-token
  vocabulary costs about 9 ms per position for each runner compared, beside 2 ms for its logits). What holds
  there is the mean and the top-1 half of the contract; see test_held_out_shapes for why not the tail's.

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
from lessons.l12_kv_quant.quality import Quality, compare, holds
from lessons.l12_kv_quant.quantize import SCALE_BYTES
from lessons.l12_kv_quant.runner import quantized
from shared.generation import StopRule
from shared.model import Qwen3ForCausalLM

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


def test_the_contract_holds_on_the_embedded_model(embedded):
    streams, q = embedded
    int8, bf16 = q["int8"], q["bf16"]
    assert int8.positions == bf16.positions == sum(map(len, streams)) >= 1000
    assert holds(int8, bf16), f"int8: {int8.line()}; bf16: {bf16.line()}"
    # Not a vacuous pass: both runners moved the distributions (a test runner that was secretly the
    # reference would score KL 0 and top-1 100%), and int8 by a margin, not a hair.
    assert 0 < int8.mean_kl < 0.8 * bf16.mean_kl and int8.p999_kl < 0.8 * bf16.p999_kl
    assert bf16.top1 < int8.top1 < 1
    w = int8.worst
    assert 0 <= w.stream < len(streams) and 0 <= w.position < len(streams[w.stream]) and w.kl >= int8.p999_kl


def test_a_bad_quantizer_fails_the_contract(embedded):
    """4-bit codes in the same rows, read by the same kernel: every measure worse than bf16's, and holds() says so."""
    _, q = embedded
    bad, bf16 = q["4-bit"], q["bf16"]
    assert not holds(bad, bf16), f"4-bit: {bad.line()}; bf16: {bf16.line()}"
    assert bad.mean_kl > bf16.mean_kl and bad.p999_kl > bf16.p999_kl and bad.top1 < bf16.top1


@pytest.mark.parametrize("name", ["untied", "gqa4_d128"])
def test_held_out_shapes(other_checkpoints, prompt_ids, name):
    """Two shapes unlike the embedded model's, built by transformers' own init (conftest). int8's mean KL is no
    larger than bf16's and its top-1 agreement no lower, as on the embedded model.

    The 99.9th percentile is not asserted against bf16's here: on these checkpoints holds() fails by it alone.
    HF's init (std 0.02) gives near-uniform next-token distributions (entropy within 0.03 nats of log 151,936),
    so every KL is about 1e-6, rounding-sized, and over a few hundred positions the p99.9 is the largest value
    or two: it compares two maxima. gqa4_d128's worst int8 position is a one-token stream's first, where the
    query attends over its own key alone and the value row's rounding passes through unaveraged. Measured
    p99.9, int8 / bf16 (the file's streams, 251 positions): untied 2.48e-6 / 2.01e-6, gqa4_d128 2.73e-6 /
    2.07e-6; with longer continuations, untied 2.3e-6 / 2.0e-6 at 511 positions and 2.0e-6 / 1.9e-6 at 1,011,
    gqa4_d128 2.6e-6 / 2.1e-6 and 2.3e-6 / 2.0e-6. So the tail is asserted within 1.5x of bf16's instead."""
    model_dir = other_checkpoints[name]
    fp32 = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, CPU)
    bf16 = Qwen3ForCausalLM.from_dir(model_dir, torch.bfloat16, CPU)
    streams = streams_of(fp32, prompt_ids, HELD_OUT_NEW)
    q = measure(fp32, bf16, streams)
    int8, yard = q["int8"], q["bf16"]
    lines = f"int8: {int8.line()}; bf16: {yard.line()}"
    assert int8.positions == sum(map(len, streams)) > 250
    assert 0 < int8.mean_kl <= yard.mean_kl, lines
    assert int8.top1 >= yard.top1, lines
    assert int8.p999_kl <= 1.5 * yard.p999_kl, lines

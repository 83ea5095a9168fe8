"""The batched engine: every request of one ragged batch equals HF run on that request alone."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_same_tokens
from lessons.l2_token_flat import L2Engine
from lessons.l3_block_tensor import L3Engine
from shared.errors import CourseError
from shared.generation import StopRule
from shared.hf_reference import HfReference
from shared.model import Qwen3ForCausalLM

CPU = torch.device("cpu")
NO_EOS = StopRule(8, ignore_eos=True)


def hf_alone(hf, prompts, stop):
    return [hf.generate(p, stop).tokens for p in prompts]


@pytest.mark.task("L3.5")
@pytest.mark.parametrize("block_size", [16, 1, 7])
def test_batch_matches_hf_alone(tiny_model, hf, prompt_ids, block_size):
    assert min(map(len, prompt_ids)) == 1 and max(map(len, prompt_ids)) > 3 * 16  # 1-token and multi-page
    engine = L3Engine(tiny_model, block_size=block_size, backend="torch")
    got = engine.generate_batch(prompt_ids, NO_EOS)
    assert len(got) == len(prompt_ids), f"{len(prompt_ids)} prompts in, {len(got)} outputs back"
    for i, (tokens, want) in enumerate(zip(got, hf_alone(hf, prompt_ids, NO_EOS))):
        assert_same_tokens(tokens, want, f"block size {block_size}, prompt {i} of one batch")
    assert engine.allocator.num_free == engine.allocator.num_blocks, (
        f"{engine.allocator.num_blocks - engine.allocator.num_free} blocks were never freed")


@pytest.mark.task("L3.5")
def test_eos_stops_each_request_on_its_own(tiny_model, hf, prompt_ids, monkeypatch):
    # Make the token HF emits third for prompt 0 the EOS: that request stops early, the others run on.
    eos = hf.generate(prompt_ids[0], StopRule(6, ignore_eos=True)).tokens[2]
    stop = StopRule(6, frozenset({eos}))
    want = hf_alone(hf, prompt_ids, stop)
    assert len(want[0]) == 3 and want[0][-1] == eos and max(map(len, want)) == 6  # EOS really exercised
    engine = L3Engine(tiny_model, block_size=4, backend="torch")
    sizes: list[int] = []  # requests in each step
    freed: list[tuple[int, int]] = []  # (steps run so far, blocks freed) per free() call
    forward, free = engine.runner.forward, engine.allocator.free
    monkeypatch.setattr(engine.runner, "forward", lambda reqs: sizes.append(len(reqs)) or forward(reqs))
    monkeypatch.setattr(engine.allocator, "free", lambda blocks: freed.append((len(sizes), len(blocks))) or free(blocks))
    assert engine.generate_batch(prompt_ids, stop) == want
    assert sizes[:3] == [len(prompt_ids)] * 3 and sizes[3] == len(prompt_ids) - 1 and len(sizes) == 6
    assert (3, -(-(len(prompt_ids[0]) + 2) // 4)) in freed  # prompt 0 gave its blocks back after step 3
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_batch_matches_l2(tiny_model, prompt_ids):
    stop = StopRule(6, ignore_eos=True)
    l2 = L2Engine(tiny_model, block_size=7)
    assert L3Engine(tiny_model, block_size=7).generate_batch(prompt_ids, stop) == [l2.generate(p, stop) for p in prompt_ids]


@pytest.mark.task("L3.5")
def test_failed_batch_frees_every_block(tiny_model, hf, prompt_ids, monkeypatch):
    engine = L3Engine(tiny_model, block_size=4, backend="torch")
    forward, calls = engine.runner.forward, []

    def failing(reqs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted failure mid-batch")
        return forward(reqs)

    monkeypatch.setattr(engine.runner, "forward", failing)
    with pytest.raises(RuntimeError, match="planted"):
        engine.generate_batch(prompt_ids, NO_EOS)
    assert engine.allocator.num_free == engine.allocator.num_blocks
    monkeypatch.setattr(engine.runner, "forward", forward)
    assert engine.generate_batch(prompt_ids[:2], NO_EOS) == hf_alone(hf, prompt_ids[:2], NO_EOS)  # pool still sound


def test_refuses_a_batch_that_cannot_fit(tiny_model, prompt_ids):
    stop = StopRule(2)
    need = sum(-(-(len(p) + 2 - 1) // 16) for p in prompt_ids)
    engine = L3Engine(tiny_model, block_size=16, num_blocks=need - 1)
    with pytest.raises(CourseError, match=f"needs {need} blocks of 16 tokens; the pool has {need - 1} free"):
        engine.generate_batch(prompt_ids, stop)
    assert engine.allocator.num_free == need - 1
    L3Engine(tiny_model, block_size=16, num_blocks=need).generate_batch(prompt_ids, stop)  # exactly enough


@pytest.mark.parametrize("kwargs,message", [
    ({"block_size": 0}, "block-size must be at least 1"),
    ({"num_blocks": 0}, "num-blocks must be at least 1"),
    ({"backend": "cuda"}, "unknown backend"),
    ({"backend": "flashinfer"}, "needs a CUDA device"),
])
def test_bad_options_are_course_errors(tiny_model, kwargs, message):
    with pytest.raises(CourseError, match=message):
        L3Engine(tiny_model, **kwargs)


@pytest.mark.parametrize("name,block_size", [("gqa4_d128", 7), ("untied", 1)])
def test_other_checkpoints(other_checkpoints, prompt_ids, name, block_size):
    model_dir = other_checkpoints[name]
    model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, CPU)
    ref = HfReference(model_dir, torch.float32, CPU)
    prompts = prompt_ids[1:]  # three lengths is enough here; the default model covers the rest
    assert L3Engine(model, block_size=block_size).generate_batch(prompts, NO_EOS) == [
        ref.generate(p, NO_EOS).tokens for p in prompts
    ]

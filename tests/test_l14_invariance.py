"""L14's engine in its batch-invariant mode: a request's logits at every output position are bitwise equal across
everything the engine does around it. The designs are vLLM's and SGLang's determinism tests, on the embedded model:

- vLLM: a needle prompt alone, then at random places among 64 fillers, over trials; batch 1 against 32, every
  step's logits; one long prompt at batch sizes 1-10, 15, 16, 17 under a token budget that slices it; a cold
  against a hot prefix cache. And its inverse test: with the mode off the same comparisons find a difference.
- SGLang: `mixed` (short and long prompts together) and `prefix` (prefix lengths 1, 511, 2048 and 4000, the
  embedded model's context being 4096, each cold after a flush and hot after another request with it).
- This engine's own: preemption (recompute), speculation (verify rows of accepted drafts against plain
  rows; an early-exit drafter's rejections too), L7's static decode path, int8 pages, seeded siblings, two threads.
- Greedy tokens still equal HF's in the mode (fp32: exactly).
"""
from __future__ import annotations

import random

import pytest
import torch

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l11_speculative.draft_model import DraftModelDrafter
from lessons.l11_speculative.early_exit import early_exit
from lessons.l14_batch_invariant import L14Engine
from lessons.l14_batch_invariant.record import first_difference, run_recorded
from shared.generation import StopRule
from conftest import assert_same_tokens
from test_l3_cpp_backend import needs_kernel
from test_l14_ops import needs_ops

pytestmark = [needs_kernel, needs_ops]
STOP = StopRule(6, ignore_eos=True)
NEEDLE = ("The capital of France is a city whose long history of kings, revolutions and artists shaped the way "
          "Europe thinks about")


def engine(model, invariant: bool = True, **options) -> L14Engine:
    return L14Engine(model, options.pop("block_size", 16), batch_invariant=invariant,
                     **({"max_running": 128} | options))


def random_prompts(count: int, seed: int, shortest: int = 3, longest: int = 40, vocab: int = 151_000):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(shortest, longest + 1))] for _ in range(count)]


def assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        difference = first_difference(a, b)
        assert difference is None, f"{what}, request {i}: {difference}"


def alone(model, prompts, stop=STOP, invariant: bool = True, **options) -> list[torch.Tensor]:
    return [run_recorded(engine(model, invariant, **options), [p], stop).logits[0] for p in prompts]


@pytest.fixture(scope="module")
def needle(tokenizer) -> list[int]:
    return tokenizer.encode(NEEDLE).ids


@pytest.mark.task("L14.4")
def test_needle_alone_equals_needle_among_64_fillers_anywhere(tiny_model, needle):
    reference = alone(tiny_model, [needle])
    for trial in range(3):
        rng = random.Random(trial)
        crowd = random_prompts(64, seed=100 + trial)
        at = rng.randrange(len(crowd) + 1)
        batch = run_recorded(engine(tiny_model), crowd[:at] + [needle] + crowd[at:], STOP)
        assert_equal([batch.logits[at]], reference, f"trial {trial}, the needle at {at} of 65")


def test_greedy_tokens_equal_hf_in_the_mode(tiny_model, prompt_ids, hf):
    stop = StopRule(12, frozenset(tiny_model.config.eos_token_ids))
    outputs = engine(tiny_model).generate_batch(prompt_ids, stop)
    for i, (ids, got) in enumerate(zip(prompt_ids, outputs)):
        assert_same_tokens(got, hf.generate(ids, stop).tokens, f"prompt {i}")


def test_preempted_and_recomputed_requests_keep_their_logits(tiny_model):
    """Recompute is the only policy from L6 on (swap would need ref-counted host blocks): the recomputed prompt and
    outputs are prompt rows now, decode rows before."""
    prompts = random_prompts(6, seed=7, shortest=20, longest=40)
    reference = alone(tiny_model, prompts)
    squeezed = engine(tiny_model, num_blocks=4, graphs=False)  # 4 blocks: about one request at a time
    got = run_recorded(squeezed, prompts, STOP)
    assert squeezed.stats.preemptions > 0
    assert_equal(got.logits, reference, "preempted and recomputed")


@pytest.mark.task("L14.4")
@pytest.mark.parametrize("drafter", ["itself", "early exit"])
def test_verify_rows_equal_plain_decode_rows(tiny_model, needle, drafter):
    prompts = [needle] + random_prompts(3, seed=9)
    reference = alone(tiny_model, prompts, StopRule(10, ignore_eos=True))
    draft = tiny_model if drafter == "itself" else early_exit(tiny_model, 2)
    spec = engine(tiny_model, drafter=DraftModelDrafter(draft), num_speculative_tokens=3)
    got = run_recorded(spec, prompts, StopRule(10, ignore_eos=True))
    assert spec.spec.accepted > 0
    if drafter == "early exit":
        assert spec.spec.accepted < spec.spec.drafted  # rejections: rows past them are not the request's
    assert_equal(got.logits, reference, f"speculation, the model's {drafter} drafting")


def test_static_decode_path_int8_pages_and_two_threads(tiny_model):
    prompts = random_prompts(5, seed=11)
    reference = alone(tiny_model, prompts, graphs=False)
    crowd = random_prompts(7, seed=12)
    assert_equal(run_recorded(engine(tiny_model, graphs=True), prompts + crowd, STOP, keep=5).logits, reference,
                 "L7's static decode buffers (padded rows)")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_equal(run_recorded(engine(tiny_model), crowd + prompts, STOP).logits[7:], reference, "two threads")
    finally:
        torch.set_num_threads(threads)
    int8_reference = alone(tiny_model, prompts, kv_dtype="int8")
    assert_equal(run_recorded(engine(tiny_model, kv_dtype="int8"), prompts + crowd, STOP, keep=5).logits,
                 int8_reference, "int8 pages")


def test_seeded_siblings_sample_as_each_seed_alone(tiny_model, needle):
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=seed)

    stop = StopRule(10, ignore_eos=True)
    solo = [run_recorded(engine(tiny_model), [needle], stop, sampling=lambda _, s=s: seeded(s)) for s in (40, 41, 42)]
    crowd = random_prompts(6, seed=13)
    got = run_recorded(engine(tiny_model), [needle] + crowd, stop, keep=1, n=lambda i: 3 if i == 0 else 1,
                       sampling=lambda i: seeded(40 if i == 0 else i))
    assert got.tokens == [r.tokens[0] for r in solo]
    assert_equal(got.logits, [r.logits[0] for r in solo], "seeded siblings")


def test_the_inverse_default_mode_differs_somewhere(tiny_model, needle):
    """vLLM's inverse test: the same comparisons, mode off, must find a difference on this CPU, or the tests above
    could not see one. Torch's matmul picks its kernel by M: a row alone and in a batch round differently."""
    reference = alone(tiny_model, [needle], invariant=False)
    crowd = random_prompts(16, seed=100)
    batch = run_recorded(engine(tiny_model, invariant=False), crowd[:5] + [needle] + crowd[5:], STOP)
    assert first_difference(batch.logits[5], reference[0]) is not None


@pytest.mark.slow
def test_batch_of_32_equals_each_alone(tiny_model):
    prompts = random_prompts(32, seed=32, shortest=2, longest=60)
    assert_equal(run_recorded(engine(tiny_model), prompts, STOP).logits, alone(tiny_model, prompts), "batch of 32")


@pytest.mark.slow
def test_long_prompt_sliced_at_batch_sizes_1_to_17(tiny_model):
    long = random_prompts(1, seed=5, shortest=300, longest=300)[0]
    others = random_prompts(16, seed=6)
    reference = None
    for size in [*range(1, 11), 15, 16, 17]:
        got = run_recorded(engine(tiny_model, max_batched_tokens=48), others[:size - 1] + [long], STOP)
        if reference is None:
            reference = got.logits[-1:]
            assert max(got.engine.prompt_slices.values()) > 1  # the budget cut the long prompt into slices
        assert_equal(got.logits[-1:], reference, f"the long prompt at batch size {size}")


@pytest.mark.slow
def test_mixed_short_and_long_prompts(tiny_model):
    lengths = [3, 500, 5, 1200, 17, 64]
    prompts = [random_prompts(1, seed=n, shortest=n, longest=n)[0] for n in lengths]
    got = run_recorded(engine(tiny_model, max_batched_tokens=256), prompts, STOP)
    assert_equal(got.logits, alone(tiny_model, prompts), "mixed lengths")


@pytest.mark.slow
@pytest.mark.parametrize("prefix_len", [1, 511, 2048, 4000])
def test_prefix_cache_cold_against_hot(tiny_model, prefix_len):
    prefix = random_prompts(1, seed=prefix_len, shortest=prefix_len, longest=prefix_len)[0]
    prompt, other = prefix + [11, 12, 13], prefix + [21, 22]
    cold = run_recorded(engine(tiny_model), [prompt], STOP)
    hot_engine = engine(tiny_model)
    hot = run_recorded(hot_engine, [prompt], STOP, first=other)
    assert hot_engine.stats.cached_tokens == prefix_len // 16 * 16  # every full block of the prefix was a hit
    assert_equal(hot.logits, cold.logits, f"prefix of {prefix_len}, cold against hot")

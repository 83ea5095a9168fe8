"""The sampler: greedy is argmax, top-k / top-p keep exactly the right support, draws follow the target
distribution, and a seeded request's draws do not depend on what else is in the batch."""
import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from lessons.l4_continuous.sampling import SamplingParams, filtered_probs, sample, sample_row
from shared.errors import CourseError

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])  # distinct, so every cut point is unambiguous
# chi-square critical values at significance 0.001, by degrees of freedom: a correct sampler fails
# one of these checks with probability 0.1%, and the fixed seeds make the outcome reproducible.
CHI2_CRIT_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


@pytest.mark.task("L4.6")
def test_temperature_zero_is_argmax():
    logits = torch.randn(7, 1000, generator=torch.Generator().manual_seed(0))
    got = sample(logits, [SamplingParams()] * 7, [None] * 7)
    assert got == logits.argmax(dim=-1).tolist(), "greedy rows (temperature 0) are the argmax of each row"


@pytest.mark.task("L4.5")
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_the_k_largest(k):
    _, ids = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=k))
    assert sorted(ids.tolist()) == list(range(k)), f"top-k {k} of {LOGITS.tolist()} keeps tokens 0..{k - 1}, got {ids.tolist()}"


@pytest.mark.task("L4.5")
@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.6, 0.8, 0.95, 1.0])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p):
    probs = torch.softmax(LOGITS, -1).tolist()
    # expected support: add tokens, most likely first, until their mass reaches top_p
    want, mass = [], 0.0
    for i, pr in enumerate(probs):
        want.append(i)
        mass += pr
        if mass >= top_p:
            break
    kept, ids = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert ids.tolist() == want, f"top-p {top_p}: the most likely tokens until their mass reaches it are {want}, got {ids.tolist()}"
    assert math.isclose(float(kept.sum()), 1.0, rel_tol=1e-6), "the kept probabilities must sum to 1"


@pytest.mark.task("L4.5")
def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    # 1 - 1e-9 rounds to 1 in fp32, so every cumulative mass is "<= 1 - top_p": only the rule that the top
    # token always stays keeps the support from being empty (and the probabilities from being NaN).
    kept, ids = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=1e-9))
    assert ids.tolist() == [0] and kept.tolist() == [1.0], (
        f"top-p 1e-9 kept tokens {ids.tolist()} with probabilities {kept.tolist()}: want [0] with [1.0], the most "
        "likely token always stays (HF's rule), so the support is never empty")


@pytest.mark.task("L4.5")
def test_top_k_then_top_p_renormalises_in_between():
    # top-k 3 leaves [2, 1, 0.5]; renormalised, token 0 alone holds ~0.63 < 0.7, so two tokens stay
    _, ids = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    assert ids.tolist() == [0, 1], (f"top-k 3 then top-p 0.7 of {LOGITS.tolist()} kept {ids.tolist()}: want [0, 1] "
                                    "(top-p measures the mass top-k left, renormalised)")


@pytest.mark.task("L4.5")
def test_top_k_keeps_every_token_tied_with_the_kth():
    _, ids = filtered_probs(torch.tensor([3.0, 2.0, 2.0, 1.0]), SamplingParams(temperature=1.0, top_k=2))
    assert ids.tolist() == [0, 1, 2], f"HF's TopKLogitsWarper keeps both 2.0s (tied with the k-th), got {ids.tolist()}"


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's own warpers, in the order its generate() applies them, then softmax."""
    scores = TemperatureLogitsWarper(p.temperature)(None, logits[None].clone())
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    return torch.softmax(scores, -1)[0]


HF_ROWS = {
    "random": torch.randn(300, generator=torch.Generator().manual_seed(5)) * 2,
    "tied at the k-th": torch.tensor([3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0]),
    "tied at the top": torch.tensor([2.0, 0.0, 2.0, 1.0, 2.0, 0.5, 0.5]),
    "tied at the nucleus edge": torch.log(torch.tensor([0.5, 0.25, 0.25])),  # exact binary masses
    "all tied": torch.zeros(8),
}
HF_PARAMS = [(1.0, 2, 1.0), (1.0, 3, 1.0), (0.7, 0, 0.9), (1.0, 0, 0.5), (1.0, 0, 0.6), (1.0, 0, 0.75),
             (1.3, 5, 0.5), (0.5, 4, 0.3), (2.0, 1, 1.0), (1.0, 0, 1.0), (0.9, 50, 0.95)]


@pytest.mark.task("L4.5")
@pytest.mark.parametrize("row", HF_ROWS, ids=list(HF_ROWS))
@pytest.mark.parametrize("temperature, top_k, top_p", HF_PARAMS)
def test_support_and_probabilities_match_hfs_warpers(row, temperature, top_k, top_p):
    logits, p = HF_ROWS[row], SamplingParams(temperature, top_k, top_p)
    want = hf_probs(logits, p)
    probs, ids = filtered_probs(logits, p)
    hf_ids = want.nonzero().flatten().tolist()
    assert set(ids.tolist()) == set(hf_ids), (f"{p}: the kept support is {sorted(ids.tolist())}, HF's warpers keep "
                                              f"{hf_ids}")
    dense = torch.zeros_like(want)
    dense[ids] = probs
    # measured 1.2e-7 (Intel Xeon AMX; torch capped to AVX2 the same): 41x margin
    assert torch.allclose(dense, want, rtol=1e-5, atol=1e-7), (
        f"{p}: the kept probabilities differ from HF's warpers' by up to {float((dense - want).abs().max()):.3g}")


def assert_one_draw_per_token(generator: torch.Generator, seed: int, tokens: int) -> None:
    replay = torch.Generator().manual_seed(seed)
    for _ in range(tokens):
        torch.rand(1, generator=replay)
    assert torch.equal(generator.get_state(), replay.get_state()), (
        f"after {tokens} sampled token(s) the request's generator is not where {tokens} torch.rand(1) draws leave "
        "it: draw exactly one uniform per token, from the request's own generator")


@pytest.mark.task("L4.6")
@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 1e-38, 1e-12])
def test_a_tiny_temperature_picks_the_argmax_with_one_draw_per_token(temperature):
    logits = torch.randn(20, 1000, generator=torch.Generator().manual_seed(3)) * 4
    g = torch.Generator().manual_seed(9)
    picks = [sample_row(row, SamplingParams(temperature), g) for row in logits]
    wrong = [i for i, (a, b) in enumerate(zip(picks, logits.argmax(dim=-1).tolist())) if a != b]
    assert not wrong, f"at temperature {temperature} rows {wrong} did not pick their argmax"
    assert_one_draw_per_token(g, 9, len(logits))


@pytest.mark.task("L4.5")
def test_a_tiny_temperature_shares_a_tie_at_the_top():
    probs, ids = filtered_probs(torch.tensor([2.0, 1.0, 2.0]), SamplingParams(1e-45))
    assert ids.tolist() == [0, 2] and probs.tolist() == [0.5, 0.5], (
        f"logits [2, 1, 2] at temperature 1e-45 kept {ids.tolist()} with {probs.tolist()}: want the tie [0, 2] at "
        "[0.5, 0.5]")


@pytest.mark.task("L4.5")
@pytest.mark.parametrize("temperature", [1.0, 1e-3, 1e-36])
def test_the_row_is_max_shifted_before_the_temperature(temperature):
    """Softmax ignores a shift, the division does not: logits of 1e4 over a tiny temperature overflow to inf
    unless the row's max is subtracted first, and inf - inf is NaN."""
    row = torch.tensor([1e4, 9990.0, 0.0, -1e4])
    probs, ids = filtered_probs(row, SamplingParams(temperature))
    assert torch.isfinite(probs).all(), (
        f"logits {row.tolist()} at temperature {temperature} give probabilities {probs.tolist()}: subtract the "
        "row's max before dividing by the temperature (max-shifted), so the top token sits at 0 and none overflows")
    want = torch.softmax((row - row.max()) / temperature, dim=-1)
    dense = torch.zeros_like(want)
    dense[ids] = probs
    assert torch.allclose(dense, want, rtol=1e-5, atol=1e-7), (
        f"logits {row.tolist()} at temperature {temperature} give {dense.tolist()}, not the max-shifted softmax "
        f"{want.tolist()}")


@pytest.mark.task("L4.6")
@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 1e-30, 1e30, 1e300])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.9), (3, 0.5)])
def test_extreme_temperatures_never_give_nan(temperature, top_k, top_p):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 30
    probs, ids = filtered_probs(logits, SamplingParams(temperature, top_k, top_p))
    where = f"temperature {temperature}, top-k {top_k}, top-p {top_p}"
    assert torch.isfinite(probs).all() and (probs > 0).all() and len(ids) >= 1, (
        f"{where}: the kept probabilities must be finite and positive, at least one: got {probs.tolist()[:5]}...")
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5), (
        f"{where}: the kept probabilities sum to {float(probs.sum())}")
    if temperature < 1:
        assert ids.tolist() == [int(logits.argmax())], (
            f"{where}: a tiny temperature keeps the argmax alone, got {ids.tolist()}")
    g = torch.Generator().manual_seed(2)
    picked = sample_row(logits, SamplingParams(temperature, top_k, top_p), g)
    assert picked in ids.tolist(), f"{where}: sample_row picked {picked}, outside the kept support"
    assert_one_draw_per_token(g, 2, 1)


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.task("L4.6")
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.5, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
])
def test_sampled_frequencies_match_the_target(params):
    probs, ids = filtered_probs(LOGITS, params)
    target = dict(zip(ids.tolist(), probs.tolist()))
    g = torch.Generator().manual_seed(1234)
    draws = [sample_row(LOGITS, params, g) for _ in range(20_000)]
    assert set(draws) <= set(target), f"{params}: drew {sorted(set(draws) - set(target))}, outside the kept support"
    counts = [draws.count(t) for t in target]
    df = len(target) - 1
    assert chi_square(counts, list(target.values())) < CHI2_CRIT_0_001[df], (
        f"{params}: 20,000 draws gave counts {dict(zip(target, counts))}, far from the probabilities "
        f"{ {k: round(v, 4) for k, v in target.items()} } (chi-square at 0.1%)")


@pytest.mark.task("L4.6")
def test_seeded_rows_are_batch_invariant():
    """A request's tokens depend on its seed and its own logits only: not on its row or its neighbours."""
    vocab, steps = 50, 30
    mine = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(7))
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=42)
    g_alone = torch.Generator().manual_seed(42)
    alone = [sample(mine[t:t + 1], [p], [g_alone])[0] for t in range(steps)]
    g_me, g_other = torch.Generator().manual_seed(42), torch.Generator().manual_seed(3)
    other_p = SamplingParams(temperature=1.3, top_k=5)
    crowded = []
    for t in range(steps):
        noise = torch.randn(3, vocab)
        batch = torch.cat([noise[:1], mine[t:t + 1], noise[1:]])  # me in row 1 among a greedy and a sampled row
        out = sample(batch, [SamplingParams(), p, other_p], [None, g_me, g_other])
        crowded.append(out[1])
    first = next((t for t, (a, b) in enumerate(zip(alone, crowded)) if a != b), None)
    assert first is None, (f"seeded row: token {first} is {crowded[first]} in a crowd, {alone[first]} alone: each "
                           "sampled row draws from its own generator, whatever its row and neighbours")


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top-p"),
    ({"top_p": 1.01}, "top-p"),
    ({"top_k": -1}, "top-k"),
    ({"temperature": float("inf")}, "temperature"),
    ({"seed": 2**64}, "seed must be an integer in .*got 18446744073709551616"),
    ({"seed": -1}, "seed must be an integer in .*got -1"),
    ({"seed": True}, "seed must be an integer in .*got True"),
    ({"seed": 3.0}, "seed must be an integer in .*got 3.0"),
])
def test_bad_sampling_params_are_course_errors(kwargs, words):
    with pytest.raises(CourseError, match=words):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1])
def test_every_seed_torch_takes_without_aliasing_is_accepted(seed):
    assert SamplingParams(1.0, seed=seed).seed == seed

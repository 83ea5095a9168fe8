"""L11's verify rules on a six-token vocabulary with hand-made logits: the emitted tokens follow the target's
distribution whatever the drafts were (a chi-square test over many seeded trials, one torch.Generator each),
the acceptance frequency is the one the rule promises (a binomial bound), a wrong rule fails the same checks,
greedy rows give exact tokens, and a seed gives the same tokens every time.

False alarms: every statistical check here uses a false-alarm rate of ALPHA = 1e-3 per check. The trials
are seeded, so a run is reproducible: a check that passes passes every time, and a change to the rule moves
the statistic, not the luck.
"""
from __future__ import annotations

import math

import pytest
import torch

from lessons.l4_continuous.sampling import SamplingParams, sample_row
from lessons.l11_speculative.verify import accept_one_hot, accept_sampled, keep_while_equal, target_probs

V = 6
N = 6000  # trials per check: each takes well under 0.1 ms, and the smallest expected count stays above 30
ALPHA = 1e-3
# Upper 1 - ALPHA quantiles of chi-square by degrees of freedom (scipy.stats.chi2.ppf(0.999, df); scipy is not
# a dependency, so the standard table's values, checked against torch's incomplete gamma below).
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
# Two-sided 1 - ALPHA normal quantile, Phi^-1(1 - ALPHA / 2), for the binomial bound on an acceptance frequency.
Z_CRITICAL = 3.2905

# The target's logits for positions n, n+1, n+2 (rows 0, 1, 2): three different distributions, none uniform.
LOGITS = torch.tensor([
    [1.0, 0.2, -0.4, 1.5, 0.1, -1.0],
    [0.3, 1.1, 0.0, -0.6, 0.8, -0.2],
    [0.5, -0.5, 1.0, 0.2, 0.0, 0.4],
])
# A drafter's distributions for the two drafts: unlike the target's, and with mass where top-k leaves p at 0.
DRAFT_PROBS = torch.tensor([
    [0.05, 0.40, 0.10, 0.10, 0.05, 0.30],
    [0.30, 0.10, 0.05, 0.25, 0.10, 0.20],
])
PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.8-topk4": SamplingParams(temperature=0.8, top_k=4),  # p is 0 on two tokens of every row
    "t1.3-topp0.9": SamplingParams(temperature=1.3, top_p=0.9),
}


def test_critical_values_are_the_stated_false_alarm_rate():
    """The hard-coded table is right: P(chi2_df > c) = Q(df/2, c/2) = ALPHA, and the normal quantile too."""
    for df, c in CHI2_CRITICAL.items():
        tail = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(c / 2, dtype=torch.float64))
        assert float(tail) == pytest.approx(ALPHA, rel=1e-3)
    assert float(torch.special.ndtri(torch.tensor(1 - ALPHA / 2, dtype=torch.float64))) == pytest.approx(Z_CRITICAL, abs=1e-4)


def chi_square(tokens: list[int], p: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value) of Pearson's goodness-of-fit test of `tokens` against p over p's support.
    A token outside the support is an outright failure, not a large statistic."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=V).double()
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens outside the target's support: {counts.tolist()} vs {p.tolist()}"
    expected = len(tokens) * p[support].double()
    assert expected.min() >= 5, "too few trials for the chi-square approximation"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, CHI2_CRITICAL[int(support.sum()) - 1]


def assert_law(tokens: list[int], p: torch.Tensor, what: str) -> None:
    stat, critical = chi_square(tokens, p)
    assert stat <= critical, f"{what}: chi-square {stat:.1f} > {critical} over {len(tokens)} tokens"


def assert_frequency(hits: int, trials: int, rate: float, what: str) -> None:
    bound = Z_CRITICAL * math.sqrt(rate * (1 - rate) / trials)
    assert abs(hits / trials - rate) <= bound, f"{what}: {hits / trials:.4f} vs {rate:.4f} +- {bound:.4f}"


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def probs(params: SamplingParams) -> list[torch.Tensor]:
    return [target_probs(row, params) for row in LOGITS]


def by_position(outputs: list[list[int]]) -> list[list[int]]:
    """[j]: the j-th emitted token of every trial that emitted at least j + 1 tokens."""
    return [[out[j] for out in outputs if len(out) > j] for j in range(max(map(len, outputs)))]


# --- (a) a one-hot drafter ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PARAMS)
def test_one_hot_rule_emits_the_targets_law(name):
    """Drafts d1, d2 proposed with certainty (d1 the target's likeliest token, so many trials reach row 1):
    the first emitted token follows p0; given d1 was kept the second follows p1, and given both were kept the
    bonus follows p2. The first draft is kept with probability p0(d1)."""
    params = PARAMS[name]
    p = probs(params)
    drafts = [int(p[0].argmax()), int(p[1].argmax())]
    outputs = [accept_one_hot(LOGITS, drafts, params, generator(seed)) for seed in range(N)]
    assert all(1 <= len(out) <= 3 and out[:len(out) - 1] == drafts[:len(out) - 1] for out in outputs)
    for j, tokens in enumerate(by_position(outputs)):
        assert_law(tokens, p[j], f"{name}: token {j}")
    assert_frequency(sum(len(out) > 1 for out in outputs), N, float(p[0][drafts[0]]), f"{name}: d1 kept")


# --- (b) a drafter that samples from q -------------------------------------------------------------------------


def sampled_trials(params: SamplingParams, rule=accept_sampled, seed0: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """N trials: drafts d1 ~ q0, d2 ~ q1 from the drafter's own generator, then the rule with the request's."""
    drafts, outputs = [], []
    for seed in range(seed0, seed0 + N):
        mine = generator(10**6 + seed)
        d = [int(torch.multinomial(q, 1, generator=mine)) for q in DRAFT_PROBS]
        drafts.append(d)
        outputs.append(rule(LOGITS, d, DRAFT_PROBS, params, generator(seed)))
    return drafts, outputs


@pytest.mark.task("L11.3")
@pytest.mark.parametrize("name", PARAMS)
def test_sampled_rule_emits_the_targets_law_and_accepts_min_p_q(name):
    """Drafts sampled from q (not p, with mass where p has none): the first emitted token follows p0 and the
    next ones p1, p2 given the drafts before them were kept; d1 is kept with probability sum_x min(p0, q0),
    and d2, given d1 was, with probability sum_x min(p1, q1)."""
    params = PARAMS[name]
    p = probs(params)
    drafts, outputs = sampled_trials(params)
    assert all(1 <= len(out) <= 3 and out[:len(out) - 1] == d[:len(out) - 1] for d, out in zip(drafts, outputs))
    for j, tokens in enumerate(by_position(outputs)):
        assert_law(tokens, p[j], f"{name}: token {j}")
    accept = [float(torch.minimum(p[j], DRAFT_PROBS[j]).sum()) for j in range(2)]
    first = sum(len(out) > 1 for out in outputs)
    assert_frequency(first, N, accept[0], f"{name}: d1 kept")
    assert_frequency(sum(len(out) > 2 for out in outputs), first, accept[1], f"{name}: d2 kept after d1")


# --- (c) the checks catch wrong rules -----------------------------------------------------------------------------


def always_accept(logits, drafts, draft_probs, params, gen) -> list[int]:
    """Wrong: keeps every draft whatever the target thinks of it, then the target's bonus."""
    return list(drafts) + [sample_row(logits[len(drafts)], params, gen)]


def resample_from_p(logits, drafts, draft_probs, params, gen) -> list[int]:
    """Wrong in a subtle way: the right acceptance test, but a rejection resamples from p instead of the
    residual max(0, p - q), so tokens the draft already had its chance at come out too often."""
    out = []
    for j, d in enumerate(drafts):
        p, q = target_probs(logits[j], params), draft_probs[j]
        if float(torch.rand(1, generator=gen)) < min(1.0, float(p[d] / q[d])):
            out.append(d)
            continue
        return out + [sample_row(logits[j], params, gen)]
    return out + [sample_row(logits[len(drafts)], params, gen)]


def one_hot_rule_on_sampled_drafts(logits, drafts, draft_probs, params, gen) -> list[int]:
    """Right in law (x ~ p, keep the draft if x equals it), but it ignores q: d1 is kept with probability
    sum_x p(x) q(x), less than sum_x min(p, q). The acceptance check must see the difference."""
    return accept_one_hot(logits, drafts, params, gen)


@pytest.mark.parametrize("wrong", [always_accept, resample_from_p], ids=lambda f: f.__name__)
def test_the_chi_square_check_rejects_a_wrong_rule(wrong):
    """The same trials and the same check as the right rule passes: the wrong rule's first token is far
    outside the bound (so a passing check above means something)."""
    params = PARAMS["t1"]
    _, outputs = sampled_trials(params, wrong)
    stat, critical = chi_square([out[0] for out in outputs], probs(params)[0])
    assert stat > critical


def test_the_one_hot_rule_fails_the_acceptance_check_for_sampled_drafts():
    params = PARAMS["t1"]
    p = probs(params)
    _, outputs = sampled_trials(params, one_hot_rule_on_sampled_drafts)
    assert_law([out[0] for out in outputs], p[0], "the one-hot rule's law is still p")
    with pytest.raises(AssertionError):
        assert_frequency(sum(len(out) > 1 for out in outputs), N, float(torch.minimum(p[0], DRAFT_PROBS[0]).sum()), "")
    assert_frequency(sum(len(out) > 1 for out in outputs), N, float((p[0] * DRAFT_PROBS[0]).sum()), "sum p q")


def test_a_one_hot_drafter_that_is_always_kept_fails_the_check():
    params = PARAMS["t1"]
    drafts = [int(probs(params)[0].argmax())]
    outputs = [always_accept(LOGITS, drafts, None, params, generator(seed)) for seed in range(N)]
    stat, critical = chi_square([out[0] for out in outputs], probs(params)[0])
    assert stat > critical


# --- (d) greedy rows: exact tokens -------------------------------------------------------------------------------

TARGETS = [2, 0, 5, 3, 1]  # the argmax of each row of GREEDY_LOGITS


def greedy_logits(targets: list[int]) -> torch.Tensor:
    logits = torch.randn(len(targets), V, generator=generator(1)).clamp(-1, 1)
    logits[range(len(targets)), targets] = 4.0
    return logits


GREEDY_LOGITS = greedy_logits(TARGETS)
K = len(TARGETS) - 1


@pytest.mark.task("L11.3")
@pytest.mark.parametrize("j", range(K + 1))
def test_greedy_keeps_the_drafts_before_the_first_mismatch(j):
    """Draft j wrong (j = K: none wrong): the row emits the drafts before it and the target's own token at j,
    which is the true argmax, not the draft; all K right gives K + 1 tokens. No random number is drawn."""
    drafts = [(t + 1) % V if i == j else t for i, t in enumerate(TARGETS[:K])]
    want = TARGETS[:j + 1]
    gen = generator(5)
    state = gen.get_state()
    assert accept_one_hot(GREEDY_LOGITS, drafts, SamplingParams(), None) == want
    assert accept_one_hot(GREEDY_LOGITS, drafts, SamplingParams(), gen) == want
    assert torch.equal(gen.get_state(), state)
    assert keep_while_equal(drafts, TARGETS) == want
    # The general rule with a greedy target (p one-hot) gives the same tokens, whatever q proposed the drafts.
    assert accept_sampled(GREEDY_LOGITS, drafts, torch.full((K, V), 1 / V), SamplingParams(), generator(5)) == want


@pytest.mark.task("L11.2")
def test_greedy_rows_with_fewer_drafts():
    assert accept_one_hot(GREEDY_LOGITS[:1], [], SamplingParams(), None) == TARGETS[:1]  # no drafts: a plain decode
    assert accept_one_hot(GREEDY_LOGITS[:3], TARGETS[:2], SamplingParams(), None) == TARGETS[:3]
    assert accept_one_hot(GREEDY_LOGITS[:3], [TARGETS[0], 4], SamplingParams(), None) == TARGETS[:2]


# --- (e) seeded: the same seed, the same tokens ------------------------------------------------------------------


@pytest.mark.task("L11.3")
@pytest.mark.parametrize("name", PARAMS)
def test_a_seed_gives_the_same_tokens(name):
    params = PARAMS[name]
    drafts = [int(probs(params)[0].argmax()), 1]
    one_hot = [accept_one_hot(LOGITS, drafts, params, generator(seed)) for seed in range(50)]
    assert one_hot == [accept_one_hot(LOGITS, drafts, params, generator(seed)) for seed in range(50)]
    sampled = [accept_sampled(LOGITS, drafts, DRAFT_PROBS, params, generator(seed)) for seed in range(50)]
    assert sampled == [accept_sampled(LOGITS, drafts, DRAFT_PROBS, params, generator(seed)) for seed in range(50)]
    assert len({tuple(out) for out in one_hot}) > 1 and len({tuple(out) for out in sampled}) > 1  # not constant


@pytest.mark.task("L11.2")
@pytest.mark.parametrize("name", PARAMS)
def test_one_hot_rule_draws_what_decoding_without_drafts_draws(name):
    """The one-hot rule emits exactly the tokens L4's sampler gives row by row with the same generator, and
    leaves the generator where those single steps leave it (one uniform per emitted token): so a seeded request
    gives the same tokens with and without speculation."""
    params = PARAMS[name]
    for seed in range(200):
        drafts = [int(t) for t in torch.randint(0, V, (2,), generator=generator(10**5 + seed))]
        a, b = generator(seed), generator(seed)
        got = accept_one_hot(LOGITS, drafts, params, a)
        plain = []
        for j in range(len(drafts) + 1):
            plain.append(sample_row(LOGITS[j], params, b))
            if j == len(drafts) or plain[-1] != drafts[j]:
                break
        assert got == plain, (f"{name}, seed {seed}, drafts {drafts}: the one-hot rule emitted {got}; L4's sampler "
                              f"row by row with the same generator gives {plain}")
        assert torch.equal(a.get_state(), b.get_state()), (
            f"{name}, seed {seed}, drafts {drafts}: after emitting {got} the generator must be where {len(plain)} "
            "single-token draws leave it (one uniform per emitted token, none for rows after a rejection)")

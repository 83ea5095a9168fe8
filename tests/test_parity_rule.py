"""The parity rule: exact in fp32; in half precision a divergence is a tie only when, in HF's own run, our
token's logit is within rounding of HF's top logit (usually: ours is the runner-up inside the margin), or
when HF run in fp32 on the same tokens picks our token. Everything else is a mismatch. After a tie HF scores our own tokens, and every later
position is judged by the same rule; our output must end exactly where our stop rule ends it."""
import pytest
import torch

from shared.generation import StopRule
from shared.hf_reference import HfOutput, _picks
from shared.parity import compare, tie_tolerance

# Position 1 (margin 0.25 at logit 48) and position 3 (0.1 at 40) are inside bf16's tolerance; 0 and 2 are not.
HF = HfOutput(tokens=[5, 6, 7, 8], margins=[3.0, 0.25, 2.0, 0.1], top_logits=[40.0, 48.0, 40.0, 40.0],
              runner_ups=[50, 9, 70, 80])
EOS = 9  # in the tests that name it
STOP = StopRule(4)  # HF's four tokens end at max_new_tokens
PROMPT = [100, 101]


class FakeHf:
    """Stands in for HF asked about our tokens, and records what it was asked.

    score: HF teacher-forced over prompt + ours. By default it agrees with the token that follows in the
    text with a clear margin (and picks 0 after the text's end); `scored` overrides positions of the
    generated text with (pick, runner-up, margin, top logit). fp32_argmax: `fp32`, an int for every
    position or a dict from position to pick.
    """

    def __init__(self, scored: dict | None = None, fp32: int | dict | None = None):
        self.table, self.fp32 = scored or {}, fp32
        self.scored, self.asked = [], []

    def score(self, ids: list[int], start: int) -> HfOutput:
        self.scored.append((list(ids), start))
        rows = []
        for k in range(start, len(ids) + 1):
            default = (ids[k] if k < len(ids) else 0, 1, 5.0, 40.0)
            rows.append(self.table.get(k - len(PROMPT), default))
        picks, runner_ups, margins, tops = (list(column) for column in zip(*rows))
        return HfOutput(picks, margins=margins, top_logits=tops, runner_ups=runner_ups)

    def fp32_argmax(self, ids: list[int]) -> int:
        self.asked.append(list(ids))
        return self.fp32 if not isinstance(self.fp32, dict) else self.fp32[len(ids) - len(PROMPT)]


def test_identical_is_a_match_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        v = compare([5, 6, 7, 8], HF, dtype, STOP)
        assert (v.status, v.judged, v.ties) == ("match", 4, ())


def test_fp32_has_no_ties():
    v = compare([5, 9, 9, 9], HF, torch.float32, STOP)
    assert (v.status, v.position, v.ours, v.theirs, v.margin, v.runner_up) == ("mismatch", 1, 9, 6, 0.25, 9)
    assert v.judged == 2  # judging stops at the mismatch


def test_bf16_runner_up_within_one_rounding_step_is_a_tie():
    assert tie_tolerance(torch.bfloat16, 48.0) == 2 * 2**-7 * 48  # two bf16 ulps-at-1 scaled by the logit
    # After the tie at 1 our continuation [1, 2] is not HF's text: HF scores it (here it agrees) and it is judged.
    hf = FakeHf()
    v = compare([5, 9, 1, 2], HF, torch.bfloat16, STOP, PROMPT, hf)
    assert (v.status, v.position, v.ours, v.runner_up, v.judged, v.ties) == ("tie", 1, 9, 9, 4, (1,))
    assert hf.scored == [(PROMPT + [5, 9, 1, 2], len(PROMPT) + 2)] and hf.asked == []  # one forward, from position 2
    v = compare([5, 6, 7, 80], HF, torch.bfloat16, STOP)  # a tie at the last token: nothing after it to score
    assert (v.status, v.judged, v.ties) == ("tie", 4, (3,))


def test_a_token_within_rounding_of_the_top_is_a_tie_wherever_topk_lists_it():
    """bf16 logits are coarse: several tokens often share a logit exactly, and topk orders them arbitrarily.
    Measured on this course's 2-core box (AVX2, no native bf16): in L4's bf16 smoke, HF had two tokens at 46.0
    and ours at 45.75, one rounding step below, third in topk's order. The rule judges our token's own logit
    in HF's run against HF's top, so its place in topk's list does not matter; a token further down does."""
    row = torch.zeros(1, 32)
    row[0, [1, 2, 4]], row[0, 3], row[0, 5] = 49.75, 49.5, 48.75  # 1, 2, 4 tie for the top; 3 is one step below
    hf = _picks(row, [1])  # generate takes the first index of a tie
    tol = tie_tolerance(torch.bfloat16, 49.75)  # 0.777: three bf16 steps of 0.25 are outside it
    for ours, gap in [(2, 0.0), (4, 0.0), (3, 0.25)]:
        v = compare([ours], hf, torch.bfloat16, StopRule(1))
        assert (v.status, v.gap, v.margin) == ("tie", gap, 0.0) and gap <= tol
    v = compare([5], hf, torch.bfloat16, StopRule(1))
    assert (v.status, v.gap) == ("mismatch", 1.0)
    v = compare([31], hf, torch.bfloat16, StopRule(1))  # at logit 0: not among HF's best, no gap to measure
    assert (v.status, v.gap) == ("mismatch", None)
    assert compare([2], hf, torch.float32, StopRule(1)).status == "mismatch"  # fp32: exact ties too are bugs


def test_a_wrong_token_at_a_small_margin_is_a_mismatch():
    """The margin alone is not enough: a garbage token where HF was nearly tied is still a bug."""
    v = compare([5, 1234, 7, 8], HF, torch.bfloat16, STOP)  # margin 0.25 <= tolerance, but 1234 is not HF's runner-up
    assert (v.status, v.position, v.ours, v.runner_up) == ("mismatch", 1, 1234, 9)
    assert compare([5, 6, 7, 81], HF, torch.bfloat16, STOP).status == "mismatch"


def test_a_clear_margin_is_a_mismatch_even_for_the_runner_up():
    assert compare([50, 6, 7, 8], HF, torch.bfloat16, STOP).status == "mismatch"  # margin 3.0 at position 0
    assert compare([5, 6, 70], HF, torch.float16, STOP).status == "mismatch"  # fp16 tolerance at 40 is 0.078 < 2.0


def test_length_differences_are_mismatches():
    v = compare([5, 6, 7], HF, torch.bfloat16, STOP)  # truncated where HF's margin was inside the tolerance
    assert v.status == "mismatch" and v.position == 3 and v.ours is None and v.judged == 3
    v = compare([5, 6], HF, torch.bfloat16, STOP)  # stopped early where HF had a clear margin
    assert v.status == "mismatch" and v.position == 2 and v.ours is None
    v = compare([5, 6, 7, 8, 9], HF, torch.bfloat16, StopRule(5))  # we went past HF's end: nothing to call a tie
    assert v.status == "mismatch" and v.position == 4 and v.theirs is None


def test_a_tie_that_picks_eos_ends_ours_early_and_is_still_a_tie():
    # HF's runner-up at position 1 is EOS: our engine stops there, one token long after the prefix. The stop
    # rule explains the end, so nothing is left to score.
    v = compare([5, EOS], HF, torch.bfloat16, StopRule(4, frozenset({EOS})))
    assert (v.status, v.position, v.ours, v.judged) == ("tie", 1, EOS, 2)


def test_the_fp32_arbiter_accepts_only_its_own_pick():
    """Position 2: margin 2.0 is far outside bf16's tolerance and 1234 is not the runner-up, so only fp32 can save it."""
    agrees = FakeHf(fp32=1234)
    v = compare([5, 6, 1234, 8], HF, torch.bfloat16, STOP, PROMPT, agrees)
    assert (v.status, v.position, v.ours, v.fp32_pick) == ("tie", 2, 1234, 1234)
    assert agrees.asked == [PROMPT + [5, 6]]  # the prompt and the tokens both runs share, nothing after

    disagrees = FakeHf(fp32=7)  # fp32 sides with HF's half-precision run: our token is wrong
    v = compare([5, 6, 1234, 8], HF, torch.bfloat16, STOP, PROMPT, disagrees)
    assert (v.status, v.fp32_pick) == ("mismatch", 7)
    assert disagrees.scored == []  # a mismatch at the first divergence: nothing after it is judged


def test_the_arbiter_is_not_asked_when_it_cannot_matter():
    never = FakeHf(fp32=9)
    assert compare([5, 9, 7, 8], HF, torch.float32, STOP, PROMPT, never).status == "mismatch"  # fp32: no exceptions
    assert compare([5, 9, 1, 2], HF, torch.bfloat16, STOP, PROMPT, never).fp32_pick is None  # the rounding rule sufficed
    assert compare([5, 6, 7], HF, torch.bfloat16, STOP, PROMPT, never).status == "mismatch"  # a length difference
    assert compare([5, 6, 7, 8], HF, torch.bfloat16, STOP, PROMPT, never).status == "match"
    assert never.asked == []


# ---------------------------------------------------------------- after a tie: HF scores our own tokens
def test_a_wrong_late_token_after_an_early_tie_is_a_mismatch():
    """The bug the first-divergence rule could not see: a tie at 1, then a wrong token at 3 on our own context."""
    hf = FakeHf(scored={3: (77, 78, 3.0, 40.0)}, fp32=77)  # on our tokens HF picks 77 at 3, clearly, in fp32 too
    v = compare([5, 9, 1, 2], HF, torch.bfloat16, STOP, PROMPT, hf)
    assert (v.status, v.position, v.ours, v.theirs, v.margin, v.runner_up, v.fp32_pick) == ("mismatch", 3, 2, 77, 3.0, 78, 77)
    assert (v.judged, v.ties) == (4, (1,))
    assert hf.asked == [PROMPT + [5, 9, 1]]  # the arbiter saw our own context, not HF's


def test_late_ties_are_judged_by_the_same_two_rules():
    rounding = FakeHf(scored={2: (11, 1, 0.25, 48.0)})  # ours (1) is HF's runner-up at 2, within bf16 rounding
    v = compare([5, 9, 1, 2], HF, torch.bfloat16, STOP, PROMPT, rounding)
    assert (v.status, v.position, v.judged, v.ties) == ("tie", 1, 4, (1, 2))  # position etc. describe the first tie
    assert rounding.asked == []

    by_fp32 = FakeHf(scored={3: (77, 78, 3.0, 40.0)}, fp32=2)  # HF's fp32 run picks ours (2) at 3
    v = compare([5, 9, 1, 2], HF, torch.bfloat16, STOP, PROMPT, by_fp32)
    assert (v.status, v.judged, v.ties) == ("tie", 4, (1, 3))
    assert by_fp32.asked == [PROMPT + [5, 9, 1]]

    wide = FakeHf(scored={2: (11, 1, 2.0, 48.0)}, fp32=11)  # the runner-up, but 2.0 is outside the tolerance
    assert compare([5, 9, 1, 2], HF, torch.bfloat16, STOP, PROMPT, wide).position == 2


def test_stopping_at_an_eos_after_a_tie_needs_that_eos_to_be_judged_acceptable():
    stop = StopRule(4, frozenset({EOS + 1}))
    eos = EOS + 1
    v = compare([5, 9, eos], HF, torch.bfloat16, stop, PROMPT, FakeHf())  # HF on our tokens picks EOS at 2 too
    assert (v.status, v.judged, v.ties) == ("tie", 3, (1,))
    hf = FakeHf(scored={2: (1, 3, 3.0, 40.0)}, fp32=1)  # HF wanted token 1 there, clearly: our EOS is wrong
    v = compare([5, 9, eos], HF, torch.bfloat16, stop, PROMPT, hf)
    assert (v.status, v.position, v.ours, v.theirs) == ("mismatch", 2, eos, 1)
    hf = FakeHf(scored={2: (1, eos, 0.25, 40.0)})  # EOS is HF's runner-up within rounding: a tie that ends ours
    assert compare([5, 9, eos], HF, torch.bfloat16, stop, PROMPT, hf).ties == (1, 2)


def test_stopping_early_after_a_tie_with_nothing_to_explain_it_is_a_mismatch():
    hf = FakeHf(scored={3: (42, 43, 1.0, 40.0)})
    v = compare([5, 9, 1], HF, torch.bfloat16, STOP, PROMPT, hf)  # 3 tokens, max 4, the last one no EOS
    assert (v.status, v.position, v.ours, v.theirs, v.judged, v.ties) == ("mismatch", 3, None, 42, 3, (1,))
    # With --ignore-eos an EOS is just a token, so ending at one before max_new_tokens is no excuse either.
    v = compare([5, EOS], HF, torch.bfloat16, StopRule(4, frozenset({EOS}), ignore_eos=True), PROMPT, FakeHf())
    assert (v.status, v.position, v.ours, v.theirs) == ("mismatch", 2, None, 0)


def test_running_on_after_a_tie_is_a_mismatch():
    stop = StopRule(4, frozenset({EOS}))
    v = compare([5, EOS, 1, 2], HF, torch.bfloat16, stop, PROMPT, FakeHf())  # the tie picked EOS, and ours went on
    assert (v.status, v.position, v.ours, v.theirs, v.ties) == ("mismatch", 2, 1, None, (1,))
    ignored = StopRule(4, frozenset({EOS}), ignore_eos=True)  # unless EOS is ignored: then it is just a token
    assert compare([5, EOS, 1, 2], HF, torch.bfloat16, ignored, PROMPT, FakeHf()).status == "tie"
    hf = FakeHf()
    v = compare([5, 9, 1, 2, 3], HF, torch.bfloat16, STOP, PROMPT, hf)  # longer than max_new_tokens
    assert (v.status, v.position, v.ours, v.theirs) == ("mismatch", 4, 3, None)
    assert hf.scored == [(PROMPT + [5, 9, 1, 2], len(PROMPT) + 2)]  # HF never reads past max_new_tokens


def test_running_on_where_hf_would_emit_eos_is_judged_like_any_token():
    """HF's argmax on our context is EOS at 2 and ours goes on: a mismatch unless our token is a tie there."""
    stop = StopRule(4, frozenset({EOS + 1}))
    clear = FakeHf(scored={2: (EOS + 1, 1, 3.0, 40.0)}, fp32=EOS + 1)
    v = compare([5, 9, 1, 2], HF, torch.bfloat16, stop, PROMPT, clear)
    assert (v.status, v.position, v.ours, v.theirs) == ("mismatch", 2, 1, EOS + 1)
    near = FakeHf(scored={2: (EOS + 1, 1, 0.25, 40.0)})  # EOS won by one rounding step over ours
    assert compare([5, 9, 1, 2], HF, torch.bfloat16, stop, PROMPT, near).ties == (1, 2)


def test_a_tie_with_tokens_left_to_judge_needs_an_oracle():
    with pytest.raises(ValueError, match="position 1"):
        compare([5, 9, 1, 2], HF, torch.bfloat16, STOP)


def test_fp32_never_asks_hf_anything():
    hf = FakeHf(fp32=9)
    assert compare([5, 9, 1, 2], HF, torch.float32, STOP, PROMPT, hf).status == "mismatch"
    assert hf.scored == [] and hf.asked == []

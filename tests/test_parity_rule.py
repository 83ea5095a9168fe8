"""The parity rule: exact in fp32; in half precision a divergence is a tie only when our token is HF's
runner-up and HF's top-2 margin is within rounding of its top logit, or when HF run in fp32 on the same
tokens picks our token. Everything else is a mismatch."""
import torch

from shared.hf_reference import HfOutput
from shared.parity import compare, tie_tolerance

# Position 1 (margin 0.25 at logit 48) and position 3 (0.1 at 40) are inside bf16's tolerance; 0 and 2 are not.
HF = HfOutput(tokens=[5, 6, 7, 8], margins=[3.0, 0.25, 2.0, 0.1], top_logits=[40.0, 48.0, 40.0, 40.0],
              runner_ups=[50, 9, 70, 80])


def test_identical_is_a_match_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert compare([5, 6, 7, 8], HF, dtype).status == "match"


def test_fp32_has_no_ties():
    v = compare([5, 9, 9, 9], HF, torch.float32)
    assert (v.status, v.position, v.ours, v.theirs, v.margin, v.runner_up) == ("mismatch", 1, 9, 6, 0.25, 9)


def test_bf16_runner_up_within_one_rounding_step_is_a_tie():
    assert tie_tolerance(torch.bfloat16, 48.0) == 2 * 2**-7 * 48  # two bf16 ulps-at-1 scaled by the logit
    v = compare([5, 9, 1, 2], HF, torch.bfloat16)  # after a tie the continuations differ: not judged
    assert (v.status, v.position, v.ours, v.runner_up) == ("tie", 1, 9, 9)
    assert compare([5, 6, 7, 80], HF, torch.bfloat16).status == "tie"


def test_a_wrong_token_at_a_small_margin_is_a_mismatch():
    """The margin alone is not enough: a garbage token where HF was nearly tied is still a bug."""
    v = compare([5, 1234, 7, 8], HF, torch.bfloat16)  # margin 0.25 <= tolerance, but 1234 is not HF's runner-up
    assert (v.status, v.position, v.ours, v.runner_up) == ("mismatch", 1, 1234, 9)
    assert compare([5, 6, 7, 81], HF, torch.bfloat16).status == "mismatch"


def test_a_clear_margin_is_a_mismatch_even_for_the_runner_up():
    assert compare([50, 6, 7, 8], HF, torch.bfloat16).status == "mismatch"  # margin 3.0 at position 0
    assert compare([5, 6, 70], HF, torch.float16).status == "mismatch"  # fp16 tolerance at 40 is 0.078 < 2.0


def test_length_differences_are_mismatches():
    v = compare([5, 6, 7], HF, torch.bfloat16)  # truncated where HF's margin was inside the tolerance
    assert v.status == "mismatch" and v.position == 3 and v.ours is None
    v = compare([5, 6], HF, torch.bfloat16)  # stopped early where HF had a clear margin
    assert v.status == "mismatch" and v.position == 2 and v.ours is None
    v = compare([5, 6, 7, 8, 9], HF, torch.bfloat16)  # we went past HF's end: nothing to call a tie
    assert v.status == "mismatch" and v.position == 4 and v.theirs is None


def test_a_tie_that_picks_eos_ends_ours_early_and_is_still_a_tie():
    eos = 9  # HF's runner-up at position 1 is EOS: our engine stops there, one token long after the prefix
    v = compare([5, eos], HF, torch.bfloat16)
    assert (v.status, v.position, v.ours) == ("tie", 1, eos)


class RecordingArbiter:
    """Stands in for HF's fp32 run: answers `pick` and records what it was asked."""

    def __init__(self, pick: int):
        self.pick, self.asked = pick, []

    def __call__(self, ids: list[int]) -> int:
        self.asked.append(list(ids))
        return self.pick


PROMPT = [100, 101]


def test_the_fp32_arbiter_accepts_only_its_own_pick():
    """Position 2: margin 2.0 is far outside bf16's tolerance and 1234 is not the runner-up, so only fp32 can save it."""
    agrees = RecordingArbiter(pick=1234)
    v = compare([5, 6, 1234, 8], HF, torch.bfloat16, PROMPT, agrees)
    assert (v.status, v.position, v.ours, v.fp32_pick) == ("tie", 2, 1234, 1234)
    assert agrees.asked == [PROMPT + [5, 6]]  # the prompt and the tokens both runs share, nothing after

    disagrees = RecordingArbiter(pick=7)  # fp32 sides with HF's half-precision run: our token is wrong
    v = compare([5, 6, 1234, 8], HF, torch.bfloat16, PROMPT, disagrees)
    assert (v.status, v.fp32_pick) == ("mismatch", 7)


def test_the_arbiter_is_not_asked_when_it_cannot_matter():
    never = RecordingArbiter(pick=9)
    assert compare([5, 9, 7, 8], HF, torch.float32, PROMPT, never).status == "mismatch"  # fp32: no exceptions
    assert compare([5, 9, 1, 2], HF, torch.bfloat16, PROMPT, never).fp32_pick is None  # the rounding rule sufficed
    assert compare([5, 6, 7], HF, torch.bfloat16, PROMPT, never).status == "mismatch"  # a length difference
    assert compare([5, 6, 7, 8], HF, torch.bfloat16, PROMPT, never).status == "match"
    assert never.asked == []

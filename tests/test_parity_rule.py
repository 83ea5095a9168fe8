"""The parity rule: exact in fp32; in half precision a divergence is a tie only within rounding of HF's top logit."""
import torch

from shared.hf_reference import HfOutput
from shared.parity import compare, tie_tolerance

HF = HfOutput(tokens=[5, 6, 7, 8], margins=[3.0, 0.25, 2.0, 0.1], top_logits=[40.0, 48.0, 40.0, 40.0])


def test_identical_is_a_match_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert compare([5, 6, 7, 8], HF, dtype).status == "match"


def test_fp32_has_no_ties():
    v = compare([5, 9, 9, 9], HF, torch.float32)
    assert (v.status, v.position, v.ours, v.theirs, v.margin) == ("mismatch", 1, 9, 6, 0.25)


def test_bf16_one_rounding_step_is_a_tie_but_a_clear_margin_is_not():
    assert tie_tolerance(torch.bfloat16, 48.0) == 2 * 2**-7 * 48  # two bf16 ulps-at-1 scaled by the logit
    assert compare([5, 9, 9, 9], HF, torch.bfloat16).status == "tie"
    assert compare([9, 9, 9, 9], HF, torch.bfloat16).status == "mismatch"  # margin 3.0 at position 0
    assert compare([5, 6, 9], HF, torch.float16).status == "mismatch"  # fp16 tolerance at 40 is 0.078 < 2.0


def test_length_differences_are_mismatches():
    v = compare([5, 6], HF, torch.bfloat16)  # we stopped early where HF had a clear margin
    assert v.status == "mismatch" and v.position == 2 and v.ours is None
    v = compare([5, 6, 7, 8, 9], HF, torch.bfloat16)  # we went past HF's end: nothing to call a tie
    assert v.status == "mismatch" and v.position == 4 and v.theirs is None

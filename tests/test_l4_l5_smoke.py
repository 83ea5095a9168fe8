"""The L4 / L5 smoke scripts keep the contract: bad sampling or scheduling input is one line and exit 2; and
L4's seeded check tells a sampling tie (logits that moved a CDF boundary across the draw) from a failure."""
import runpy

import pytest
import torch

from lessons.l4_continuous import SamplingParams
from test_bad_input import ROOT, run_script


@pytest.mark.parametrize("argv, words", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--top-k", "-2"], "top-k must be >= 0"),
    (["--max-running", "0"], "max-running must be at least 1"),
    (["--max-new-tokens", "0"], "max-new-tokens must be at least 1"),
    (["--num-blocks", "1", "--block-size", "4"], "the whole pool has 1"),
    # request 0 samples with seed 2**64 - 1, which torch takes; request 1's SEED + 1 is one past it
    (["--temperature", "1", "--seed", str(2**64 - 1)],
     "request 1's seed (--seed + 1) must be an integer in [0, 2**64 - 1], got 18446744073709551616"),
    (["--seed", "-1"], "request 0's seed (--seed + 0) must be an integer in [0, 2**64 - 1], got -1"),
])
def test_l4_smoke_rejects(argv, words, capsys):
    code, out, err = run_script("l4_smoke.py", argv, capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert words in err


@pytest.mark.parametrize("argv, words", [
    (["--policy", "lru"], "invalid choice"),
    (["--host-blocks", "0", "--policy", "swap"], "host-blocks must be at least 1"),
])
def test_l5_smoke_rejects(argv, words, capsys):
    code, out, err = run_script("l5_smoke.py", argv, capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert words in err


@pytest.fixture(scope="module")
def l4_smoke():
    return runpy.run_path(str(ROOT / "scripts" / "l4_smoke.py"))  # its functions, without running main


def two_way_rows(shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    alone = torch.zeros(2)  # tokens 0 and 1 equally likely: the CDF boundary between them is at 0.5
    return alone, alone + torch.tensor([0.0, shift])


def test_a_divergence_across_a_moved_boundary_is_a_numerical_tie(l4_smoke):
    alone, crowd = two_way_rows(1e-4)  # token 1 gains 2.5e-5 of mass: the boundary moves to 0.499975
    tie, why = l4_smoke["explain"](alone, crowd, torch.tensor([0.49999]), SamplingParams(1.0), (0, 1))
    assert tie and why.startswith("NUMERICAL TIE, not a failure")
    assert "logits differ by up to 0.0001" in why and "moved 2.5e-05" in why


@pytest.mark.parametrize("shift, u, words", [
    (0.0, 0.49999, "bitwise equal"),  # same logits, different tokens: the sampler is at fault
    (1e-4, 0.2, "the draws themselves differed"),  # u far from the boundary: logits cannot explain it
])
def test_a_divergence_the_logits_cannot_explain_is_a_failure(l4_smoke, shift, u, words):
    alone, crowd = two_way_rows(shift)
    tie, why = l4_smoke["explain"](alone, crowd, torch.tensor([u]), SamplingParams(1.0), (0, 1))
    assert not tie and words in why


def test_the_replayed_uniform_is_the_one_the_request_drew(l4_smoke):
    g = torch.Generator().manual_seed(77)
    draws = [torch.rand(1, generator=g) for _ in range(5)]
    assert torch.equal(l4_smoke["uniform_at"](77, 4, torch.device("cpu")), draws[4])

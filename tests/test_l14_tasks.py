"""L14's tasks that the invariance tests do not isolate: the record (task 1), the model's twin (task 3) and the
engine's refusals (task 4). Tasks 2 and 4's invariance: tests/test_l14_ops.py and tests/test_l14_invariance.py."""
from __future__ import annotations

import struct

import pytest
import torch
from torch import nn

from lessons.l11_speculative.draft_model import DraftModelDrafter
from lessons.l11_speculative.early_exit import early_exit
from lessons.l13_structured import L13Engine
from lessons.l14_batch_invariant import L14Engine
from lessons.l14_batch_invariant.model import InvariantLinear, InvariantRMSNorm, invariant_model
from lessons.l14_batch_invariant.record import first_difference, run_recorded
from shared.errors import CourseError
from shared.generation import StopRule
from shared.layers import RMSNorm
from test_l3_cpp_backend import needs_kernel
from test_l14_ops import needs_ops


def bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


@pytest.mark.task("L14.1")
def test_first_difference_names_the_output_the_token_and_the_bit():
    a = torch.zeros(3, 5)
    assert first_difference(a, a.clone()) is None, "two equal records have no first difference: None"
    b = a.clone()
    b[1, 3] = torch.tensor(bits(1.0) + 1, dtype=torch.int32).view(torch.float32)  # 1.0 and the next float up
    a[1, 3] = 1.0
    said = first_difference(a, b)
    assert said is not None, ("output 1, token 3 holds 1.0 (0x3f800000) against the next float up (0x3f800001): "
                              "one bit apart is a difference (compare the bits, not the values within a tolerance)")
    assert said.startswith("output 1, token 3: 1.0 (0x3f800000)") and "mantissa bit 0" in said, (
        f"name the output, the token, both values with their bits and the highest differing bit; got {said!r}")
    assert "1 of 3 rows differ" in said, f"say how many rows differ (1 of 3); got {said!r}"
    a[2, 0], b[2, 0] = 2.0, -2.0
    said = first_difference(a, b)
    assert said is not None and "output 1, token 3" in said, f"the first difference in order, not the largest: {said!r}"
    said = first_difference(a[2:], b[2:])
    assert said is not None and "the sign" in said, f"2.0 against -2.0 differ in the sign bit; got {said!r}"
    said = first_difference(a, b[:2])
    assert said is not None and "shapes differ" in said, f"3 outputs against 2: the shapes differ; got {said!r}"
    zero, negative_zero = torch.zeros(1, 1), torch.tensor([[-0.0]])
    assert first_difference(zero, negative_zero) is not None, "0.0 and -0.0 are equal as numbers, not as bits"


@pytest.mark.task("L14.1")
def test_the_record_keeps_the_row_each_output_token_was_chosen_from(tiny_model, prompt_ids):
    """On L13's engine (no mode needed): greedy, token i is the argmax of row i, including rows of verified drafts
    from an early-exit drafter (some rejected: rows past a rejection are not kept) and a prompt's last slice."""
    engine = L13Engine(tiny_model, 16, max_batched_tokens=24, drafter=DraftModelDrafter(early_exit(tiny_model, 2)),
                       num_speculative_tokens=3)
    got = run_recorded(engine, prompt_ids, StopRule(12, ignore_eos=True), keep=3)
    assert len(got.logits) == 3 and engine.spec.drafted > engine.spec.accepted > 0
    for i, (tokens, rows) in enumerate(zip(got.tokens, got.logits)):
        assert rows.shape == (12, tiny_model.config.vocab_size) and rows.dtype == torch.float32, (
            f"request {i}: one fp32 row per output token, [12, vocab]; got {rows.dtype} {list(rows.shape)}")
        wrong = [j for j, (row, token) in enumerate(zip(rows.argmax(-1).tolist(), tokens)) if row != token]
        assert not wrong, (f"request {i}: greedy, output token j is the argmax of its row, but not at outputs {wrong}: "
                           "a verify row past a rejected draft saw that draft, and stands for no output token")


@needs_ops
@pytest.mark.task("L14.3")
def test_the_twin_shares_every_weight_and_leaves_the_model_alone(tiny_model):
    twin = invariant_model(tiny_model)
    assert twin is not tiny_model
    assert {p.data_ptr() for p in twin.parameters()} == {p.data_ptr() for p in tiny_model.parameters()}
    layers = tiny_model.config.num_hidden_layers
    swapped = [m for m in twin.modules() if isinstance(m, (InvariantLinear, InvariantRMSNorm))]
    assert len([m for m in swapped if isinstance(m, InvariantLinear)]) == 7 * layers + 1  # q k v o gate up down, head
    assert len([m for m in swapped if isinstance(m, InvariantRMSNorm)]) == 4 * layers + 1  # 2 per layer, q/k, final
    assert not any(isinstance(m, (nn.Linear, RMSNorm)) for m in twin.modules())
    assert not any(isinstance(m, (InvariantLinear, InvariantRMSNorm)) for m in tiny_model.modules())
    hidden = torch.randn(9, tiny_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    rows = twin.logits(hidden)
    assert torch.equal(twin.logits(hidden[4:5])[0], rows[4])  # the LM head too: one row alone = in nine
    # measured 3.2e-5 (Intel Xeon AMX), 3.1e-5 (torch capped to AVX2): 9.5x margin
    torch.testing.assert_close(rows, tiny_model.logits(hidden), atol=1e-4, rtol=1e-4)


@needs_kernel
@needs_ops
@pytest.mark.task("L14.4")
def test_the_mode_is_a_choice_and_refuses_what_it_cannot_make_invariant(tiny_model, tiny_dir):
    assert L14Engine(tiny_model, 16).model is tiny_model  # off: L13's engine on the model as given
    on = L14Engine(tiny_model, 16, batch_invariant=True)
    assert on.model is not tiny_model and on.runner.backend.name == "cpp"
    for backend in ("torch", "batched", "flashinfer"):
        with pytest.raises(CourseError, match=f"not --backend {backend}"):
            L14Engine(tiny_model, 16, backend=backend, batch_invariant=True)
    with pytest.raises(CourseError, match="True or False, got 'yes'"):
        L14Engine(tiny_model, 16, batch_invariant="yes")
    from shared.model import Qwen3ForCausalLM

    half = Qwen3ForCausalLM.from_dir(tiny_dir, torch.float16, torch.device("cpu"))
    with pytest.raises(CourseError, match="float32 or bfloat16, not float16") as refused:
        L14Engine(half, 16, batch_invariant=True)
    assert "\n" not in str(refused.value)

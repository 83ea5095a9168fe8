"""The quantizer (lessons/l12_kv_quant/quantize.py): symmetric absmax int8, one fp32 scale per row, and the packed
row layout the pool stores (D codes, then the scale's 4 bytes).

The round-trip bound: code = round(x / scale) is the nearest step, so |code x scale - x| <= scale / 2. In fp32
two roundings sit on top of that: x / scale is rounded (relative 2^-24 of a quotient of at most 127 steps) and
so is code x scale (relative 2^-24 of at most 127 steps). Each adds at most 127 x 2^-24 of a step, so the
tests allow scale x (1/2 + 2 x 127 x 2^-24), about 1.5e-5 of a step over the half: a few ulps, never a step.
Every bound is also shown to be tight (some element of random data is off by more than 0.4 of a step), so
a quantizer that returned its input, or one with half the step, fails here.
"""
from __future__ import annotations

import struct

import pytest
import torch

from lessons.l12_kv_quant.quantize import QMAX, SCALE_BYTES, dequantize, pack_rows, quantize, unpack_rows

D = 128
# fp32 rounding on top of the half step: x / scale and code x scale are each rounded once (see the docstring).
FP32_SLACK = 2 * QMAX * 2.0**-24


def half_step(scales: torch.Tensor) -> torch.Tensor:
    return scales * (0.5 + FP32_SLACK)


def round_trip_error(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, |dequantize - x|) against x widened to fp32 (a bf16 input is exact in fp32)."""
    codes, scales = quantize(x)
    return codes, scales, (dequantize(codes, scales) - x.float()).abs()


@pytest.mark.task("L12.1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_round_trip_within_half_a_step(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes, as K and V rows are across layers and heads.
    x = (torch.randn(64, 4, D, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]).to(dtype)
    codes, scales, err = round_trip_error(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (*x.shape[:-1], 1)
    assert (err <= half_step(scales)).all()
    # Tight: every row has an element off by more than 0.4 of a step (uniform rounding errors over 128 elements
    # all below 0.4 would have probability 0.8^127), so a finer "quantizer" (or none at all) fails here.
    assert (err.amax(dim=-1, keepdim=True) > 0.4 * scales).all()
    # The scale is the row's absmax over 127: its largest element is code +-127 exactly.
    absmax = x.float().abs().amax(dim=-1, keepdim=True)
    assert torch.equal(scales, absmax / QMAX)
    at_max = codes.gather(-1, x.float().abs().argmax(dim=-1, keepdim=True))
    assert (at_max.abs() == QMAX).all()


@pytest.mark.task("L12.1")
def test_a_row_of_zeros_comes_back_exactly():
    x = torch.randn(3, D)
    x[1] = 0.0  # a zero row among others: its scale must not come from its neighbours, nor be a NaN
    codes, scales, err = round_trip_error(x)
    assert scales[1].item() == 0.0 and (scales[[0, 2]] > 0).all()
    assert (codes[1] == 0).all()
    assert torch.equal(dequantize(codes, scales)[1], torch.zeros(D))
    assert not torch.isnan(dequantize(codes, scales)).any()


@pytest.mark.task("L12.1")
def test_an_outlier_sets_the_step_for_its_whole_row():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(D, generator=g) * 0.01
    x[17] = 100.0
    codes, scales, err = round_trip_error(x)
    scale = scales.item()
    assert scale == pytest.approx(100.0 / QMAX, rel=1e-6)
    assert codes[17].item() == QMAX
    assert dequantize(codes, scales)[17].item() == pytest.approx(100.0, rel=2**-22)  # exact but for fp32 rounding
    # The others are within half of THE OUTLIER'S step, and that step (0.79) swallows them: all round to 0.
    others = torch.arange(D) != 17
    assert (err[others] <= scale * (0.5 + FP32_SLACK)).all()
    assert (codes[others] == 0).all()
    assert torch.equal(err[others], x[others].abs())  # what per-row absmax costs a row with one outlier


@pytest.mark.task("L12.1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [3.0, -3.0, 1.0 / 3, -250.0, 1e-3, -7e-30])
def test_a_row_of_constants_is_all_plus_or_minus_127(value: float, dtype: torch.dtype):
    x = torch.full((D,), value, dtype=dtype)
    codes, scales, err = round_trip_error(x)
    assert (codes == (QMAX if value > 0 else -QMAX)).all()
    assert torch.equal(scales, x[:1].float().abs() / QMAX)
    # 127 x fl(|c| / 127) is |c| but for two fp32 roundings: a couple of ulps, far inside half a step.
    torch.testing.assert_close(dequantize(codes, scales), x.float(), rtol=2 * 2.0**-23, atol=0)


@pytest.mark.task("L12.1")
def test_codes_never_use_minus_128():
    # Rows whose absmax is negative: the symmetric grid gives it -127 (a grid with -128 would let x / scale
    # reach it, and negating -128 overflows int8).
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, D, generator=g)
    x[:, 5] = -x.abs().amax(dim=-1) * 1.5
    codes, scales, err = round_trip_error(x)
    assert codes.min().item() == -QMAX
    assert (codes[:, 5] == -QMAX).all()
    assert (err <= half_step(scales)).all()


@pytest.mark.task("L12.2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_hold_the_codes_then_the_scales_bytes(dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 2, 64, generator=g).to(dtype)  # [N, S, Hkv, D], the pool's shape
    x[2, 3, 1] = 0.0
    codes, scales = quantize(x)
    rows = pack_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 7, 2, 64 + SCALE_BYTES)
    assert torch.equal(rows[..., :64], codes)
    # The last 4 bytes of a row are its fp32 scale's bytes, in the machine's byte order (the kernel memcpy's them).
    for index in [(0, 0, 0), (2, 3, 1), (4, 6, 1)]:
        tail = bytes(rows[index][64:].view(torch.uint8).tolist())
        assert tail == struct.pack("=f", scales[index].item())
    # unpack_rows undoes pack_rows exactly as dequantize undoes quantize, on the pool and on gathered rows.
    assert torch.equal(unpack_rows(rows), dequantize(codes, scales))
    strided = rows[:, ::2]  # a non-contiguous view, as the oracle's gathers can be
    assert torch.equal(unpack_rows(strided), dequantize(codes, scales)[:, ::2])
    assert unpack_rows(rows).dtype == torch.float32
    assert (unpack_rows(rows)[2, 3, 1] == 0).all()

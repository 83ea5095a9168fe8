"""L16's weight blocks (lessons/l16_weight_quant/blocks.py) against the `gguf` package's reference, byte for byte.

- quantize writes exactly gguf.quants.quantize's bytes for Q8_0 and Q4_1, on random fp32 and bf16 matrices and on
  the blocks a quantizer gets wrong first: all zero, constant, negative only, exact .5 ties and the float just
  below 0.5 (C's roundf gives 0 there; floor(x + 0.5) gives 1), huge and tiny magnitudes (scales past fp16's range
  or below its smallest), one block per row (K = 32).
- dequantize (torch) is gguf.quants.dequantize to the bit, on those blocks and on random bytes with every q and
  nibble value; the C++ op (shared/cpu_ops.cpp `dequantize`) is the same bits, on 1 and 2 threads.
- Bad shapes and formats are one line (CourseError) naming the bad value.
Hand-worked blocks check the layout (scale first, nibble j low with j + 16 high) without gguf installed.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from lessons.l16_weight_quant.blocks import BLOCK, FORMATS, dequantize, quantize
from shared.cpu_ops import load_ops
from shared.errors import CourseError
from shared.kernel_build import KernelUnavailable

HAS_GGUF = importlib.util.find_spec("gguf") is not None
needs_gguf = pytest.mark.skipif(not HAS_GGUF, reason="compares with the gguf package's quantizer: pip install gguf")
try:
    OPS = load_ops()
except KernelUnavailable as e:
    OPS, WHY = None, str(e)
needs_ops = pytest.mark.skipif(OPS is None, reason=f"the C++ decode ops are unavailable: {WHY if OPS is None else ''}")
FMTS = list(FORMATS)
BELOW_HALF = float(np.nextafter(np.float32(0.5), np.float32(0)))  # 0.49999997: roundf gives 0


def gguf_type(fmt: str):
    import gguf

    return {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}[fmt]


def gguf_quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """gguf's reference quantizer on w's values as fp32 (what llama.cpp's converter hands it for bf16 too)."""
    from gguf.quants import quantize as reference

    with np.errstate(over="ignore", invalid="ignore"):  # the edge blocks' scales past fp16's range: inf, as ours
        return torch.from_numpy(reference(w.float().numpy(), gguf_type(fmt)))


def gguf_dequantize(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    from gguf.quants import dequantize as reference

    with np.errstate(over="ignore", invalid="ignore"):  # inf scales times q = 0: NaN, as ours
        return torch.from_numpy(reference(blocks.numpy(), gguf_type(fmt)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 values as their bits: 0.0 and -0.0 differ, as do NaNs with other payloads."""
    return t.contiguous().view(torch.int32)


def edge_blocks() -> torch.Tensor:
    """One block per row, each a case a quantizer can get wrong: [rows, 32] fp32."""
    g = torch.Generator().manual_seed(16)
    ties = torch.tensor([127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, BELOW_HALF, -BELOW_HALF,
                         1.4999999, 2.5000002, 0.0, -0.0, 63.5] + [0.0] * 16)  # max 127: d = 1, q = roundf(w)
    # Q4_1 ties: min 0, max 15 -> d = 1, q = trunc(w + 0.5)
    q4_ties = torch.tensor([0.0, 15.0, 0.5, 1.5, 14.5, BELOW_HALF, 7.4999995, 7.5, 3.5, 12.5] + [0.0] * 22)
    rows = [
        torch.zeros(BLOCK),  # d = 0: every q 0, no division by zero
        -torch.zeros(BLOCK),
        torch.full((BLOCK,), 0.3),  # constant: Q4_1 d = 0, m = the value
        torch.full((BLOCK,), -7.25),
        -torch.rand(BLOCK, generator=g) - 0.5,  # negative only
        torch.rand(BLOCK, generator=g) + 2.0,  # positive only, away from zero: Q4_1 keeps all 16 levels
        ties, -ties, q4_ties,
        torch.randn(BLOCK, generator=g) * 6e4,  # near fp16's largest scale
        torch.randn(BLOCK, generator=g) * 1e7,  # scales past fp16's range: stored as inf
        torch.randn(BLOCK, generator=g) * 1e-6,  # scales among fp16's subnormals
        torch.randn(BLOCK, generator=g) * 1e-30,  # scales below fp16's smallest: stored as 0
        torch.cat([torch.full((31,), 1e-3), torch.tensor([1e4])]),  # one outlier takes the block's range
        torch.arange(BLOCK, dtype=torch.float32) - 16,  # every level once
    ]
    return torch.stack(rows)


def random_matrix(n: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 1, n)[:, None]  # rows of different magnitudes, as a model's are
    return (torch.randn(n, k, generator=g) * scale).to(dtype)


def random_blocks(n: int, k: int, fmt: str, seed: int) -> torch.Tensor:
    """Random bytes (every q and nibble value) with finite fp16 scales of every size, [n, k / 32 * bytes]."""
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n * k // BLOCK, f.block_bytes), generator=g, dtype=torch.uint8)
    scales = 2 if fmt == "q8_0" else 4  # d (and m)
    values = torch.randn(b.shape[0], scales // 2, generator=g) * torch.logspace(-6, 3, b.shape[0])[:, None]
    b[:, :scales] = values.to(torch.float16).view(torch.uint8).reshape(-1, scales)
    return b.reshape(n, f.row_bytes(k))


# --- by hand (no gguf needed) ----------------------------------------------------------------------------------


def test_bits_per_weight_and_row_bytes():
    assert FORMATS["q8_0"].bits_per_weight == 8.5 and FORMATS["q4_1"].bits_per_weight == 5.0
    assert FORMATS["q8_0"].row_bytes(576) == 18 * 34 and FORMATS["q4_1"].row_bytes(576) == 18 * 20


@pytest.mark.task("L16.1")
def test_a_q8_0_block_by_hand():
    w = torch.zeros(1, BLOCK)
    w[0, :8] = torch.tensor([127.0, 0.5, -0.5, 2.5, -2.5, BELOW_HALF, -3.0, 1.4999999])
    blocks = quantize(w, "q8_0")
    assert blocks.dtype == torch.uint8 and blocks.shape == (1, 34)
    assert blocks[0, :2].view(torch.float16).item() == 1.0, "d = max|w| / 127, stored as fp16 first"
    q = blocks[0, 2:].view(torch.int8)
    # roundf: halves away from zero; 0.49999997 rounds to 0 (floor(x + 0.5) would give 1: x + 0.5 rounds up to 1.0)
    assert q[:8].tolist() == [127, 1, -1, 3, -3, 0, -3, 1], q[:8].tolist()
    assert not q[8:].any()
    assert torch.equal(dequantize(blocks, "q8_0")[0, :8], torch.tensor([127.0, 1, -1, 3, -3, 0, -3, 1]))


@pytest.mark.task("L16.1")
def test_a_q4_1_block_by_hand():
    w = torch.arange(BLOCK, dtype=torch.float32) % 16 + 2.0  # 2..17 twice: min 2, d = 1, q = w - 2
    w[5] = 2.5  # a tie: trunc(0.5 + 0.5) = 1
    blocks = quantize(w[None], "q4_1")
    assert blocks.shape == (1, 20)
    d, m = blocks[0, :4].view(torch.float16).tolist()
    assert (d, m) == (1.0, 2.0), "d = (max - min) / 15 and m = min, fp16 each, d first"
    nib = blocks[0, 4:]
    q = (w - 2).round().to(torch.uint8)  # 2.5 -> 0.5 -> rounds to 0 here, to 1 in the format: set below
    q[5] = 1
    assert torch.equal(nib & 15, q[:16]) and torch.equal(nib >> 4, q[16:]), "byte j: weight j low, j + 16 high"
    assert dequantize(blocks, "q4_1")[0, 5].item() == 3.0


@pytest.mark.task("L16.1")
@pytest.mark.parametrize("fmt", FMTS)
def test_bf16_weights_quantize_as_their_fp32_values(fmt):
    w = random_matrix(6, 64, 1, torch.bfloat16)
    assert torch.equal(quantize(w, fmt), quantize(w.float(), fmt))


@pytest.mark.task("L16.1")
@pytest.mark.parametrize("fmt", FMTS)
def test_a_round_trip_is_within_half_a_step(fmt):
    w = random_matrix(8, 96, 2, torch.float32)
    back = dequantize(quantize(w, fmt), fmt)
    assert back.shape == w.shape and back.dtype == torch.float32
    blocks = w.reshape(-1, BLOCK)
    step = blocks.abs().amax(1) / 127 if fmt == "q8_0" else (blocks.amax(1) - blocks.amin(1)) / 15
    err = (back - w).reshape(-1, BLOCK).abs().amax(1)
    # half a step, plus the fp16 rounding of the scale (and of m) across the block
    # (and fp16's subnormal scales: an absolute 2^-24 each, times up to 127)
    assert (err <= 0.5 * step + blocks.abs().amax(1) * 2 ** -9 + 127 * 2 ** -24).all()


# --- against gguf ----------------------------------------------------------------------------------------------


@needs_gguf
@pytest.mark.task("L16.1")
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_writes_ggufs_bytes_on_the_edge_blocks(fmt):
    w = edge_blocks()
    ours, theirs = quantize(w, fmt), gguf_quantize(w, fmt)
    differ = (ours != theirs).any(1).nonzero().flatten().tolist()
    assert not differ, f"{fmt}: edge blocks {differ} differ from gguf's; the first: ours {ours[differ[0]].tolist()}, " \
                       f"gguf's {theirs[differ[0]].tolist()}"
    # the rows folded into one matrix (rows of several blocks) write the same bytes
    wide = w[:12].reshape(3, 4 * BLOCK)
    assert torch.equal(quantize(wide, fmt), gguf_quantize(wide, fmt))


@needs_gguf
@pytest.mark.task("L16.1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (64, 576)])
def test_quantize_writes_ggufs_bytes_on_random_matrices(fmt, dtype, n, k):
    w = random_matrix(n, k, n * k, dtype)
    ours = quantize(w, fmt)
    assert ours.dtype == torch.uint8 and ours.shape == (n, FORMATS[fmt].row_bytes(k)) and ours.is_contiguous()
    assert torch.equal(ours, gguf_quantize(w, fmt))


@needs_gguf
@pytest.mark.task("L16.1")
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_is_ggufs_to_the_bit(fmt):
    for blocks in (quantize(edge_blocks(), fmt), random_blocks(33, 128, fmt, 3)):
        theirs = gguf_dequantize(blocks, fmt)
        ours = dequantize(blocks, fmt)
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape
        assert torch.equal(bits(ours), bits(theirs))


@needs_ops
@needs_gguf
@pytest.mark.parametrize("fmt", FMTS)
def test_the_cpp_dequantize_is_ggufs_to_the_bit_on_any_thread_count(fmt):
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for blocks, k in ((quantize(edge_blocks(), fmt), BLOCK), (random_blocks(37, 192, fmt, 4), 192),
                              (random_blocks(1, 32, fmt, 5), 32)):
                theirs = gguf_dequantize(blocks, fmt)
                ours = OPS.dequantize(blocks, fmt, k)
                assert ours.dtype == torch.float32 and ours.shape == theirs.shape
                assert torch.equal(bits(ours), bits(theirs)), f"{fmt}, K {k}, {count} threads"
                # a row slice (not the tensor's start) and a non-contiguous one read the right bytes
                assert torch.equal(bits(OPS.dequantize(blocks[1:], fmt, k)), bits(theirs[1:]))
                assert torch.equal(bits(OPS.dequantize(blocks[::2], fmt, k)), bits(theirs[::2]))
    finally:
        torch.set_num_threads(threads)


# --- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.task("L16.1")
@pytest.mark.parametrize("shape, fmt, said", [
    ((4, 48), "q8_0", "K a multiple of 32, got [4, 48]"),
    ((64,), "q4_1", "got [64]"),
    ((2, 2, 32), "q8_0", "got [2, 2, 32]"),
    ((4, 32), "q4_0", "unknown block format 'q4_0': use q8_0 or q4_1"),
    ((4, 32), "Q8_0", "unknown block format 'Q8_0'"),
])
def test_quantize_refuses_bad_shapes_and_formats_in_one_line(shape, fmt, said):
    with pytest.raises(CourseError) as caught:
        quantize(torch.randn(shape), fmt)
    assert said in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


@pytest.mark.task("L16.1")
@pytest.mark.parametrize("make, fmt, said", [
    (lambda: torch.zeros(2, 34, dtype=torch.uint8), "q4_0", "unknown block format 'q4_0'"),
    (lambda: torch.zeros(2, 51, dtype=torch.uint8), "q8_0", "[2, 51]"),  # 102 bytes: 3 blocks, not 2 whole rows
    (lambda: torch.zeros(2, 35, dtype=torch.uint8), "q8_0", "[2, 35]"),
    (lambda: torch.zeros(3, 20, dtype=torch.uint8), "q8_0", "[3, 20]"),  # q4_1 rows read as q8_0
    (lambda: torch.zeros(68, dtype=torch.uint8), "q8_0", "[68]"),
    (lambda: torch.zeros(2, 34), "q8_0", "float32"),
])
def test_dequantize_refuses_bad_blocks_and_formats_in_one_line(make, fmt, said):
    with pytest.raises(CourseError) as caught:
        dequantize(make(), fmt)
    assert said in str(caught.value) and "\n" not in str(caught.value), str(caught.value)

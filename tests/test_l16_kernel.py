"""L16's block kernel (shared/cpu_ops.cpp `linear_blocks`) and the modules that call it (quant_linear.py).

- linear_blocks(x, blocks) is bitwise ops.linear(x, the dequantized weights) at M = 1..20 and 64, for N not a
  multiple of the 4-column tile or the 64-column thread block and K from one block (32) to SmolLM2's 576, Q8_0 and
  Q4_1, on 1 and 2 threads; each row of a batch is bitwise the row computed alone (the kernel's order is per row).
- Bad inputs (x's dtype, K not a multiple of 32, a row of blocks of the wrong width, an unknown format) are a
  RuntimeError of one line, never a crash.
- QuantLinear takes the block kernel for at most 16 rows and torch's GEMM over the dequantized weights beyond,
  each bitwise what shared.layers.Linear computes over those weights (L14's mode: the kernel for every row count,
  bitwise its ops.linear); with $PAGED_COURSE_CPU_OPS=0 bitwise Linear with the ops off. QuantEmbedding gives the
  dequantized rows, dequantizing only the rows asked for.
tests/test_other_cpus.py runs this file against the AVX2 build (the kernel's __AVX2__ branches).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lessons.l16_weight_quant.blocks import BLOCK, FORMATS, dequantize, quantize
from lessons.l16_weight_quant.quant_linear import QuantEmbedding, QuantLinear
from shared import cpu_ops
from shared.kernel_build import KernelUnavailable
from shared.layers import Linear

try:
    OPS = cpu_ops.load_ops()
except KernelUnavailable as e:
    OPS, WHY = None, str(e)
pytestmark = pytest.mark.skipif(OPS is None, reason=f"the C++ decode ops are unavailable: {WHY if OPS is None else ''}")

FMTS = list(FORMATS)
ROWS = list(range(1, 21)) + [64]  # tiles change every 4 rows, QuantLinear's switch after 16, a prefill's block
SHAPES = [(32, 67), (64, 5), (96, 130), (576, 66)]  # (K, N): one block; N past the tile and the 64-column block


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def blocks_of(n: int, k: int, fmt: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=g) / k ** 0.5, fmt)


def random_bytes_blocks(n: int, k: int, fmt: str, seed: int) -> torch.Tensor:
    """Every q and nibble value, scales (and Q4_1's m) from fp16's whole ordinary range."""
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n * k // BLOCK, f.block_bytes), generator=g, dtype=torch.uint8)
    scales = 2 if fmt == "q8_0" else 4
    values = torch.randn(b.shape[0], scales // 2, generator=g) * torch.logspace(-5, 1, b.shape[0])[:, None]
    b[:, :scales] = values.to(torch.float16).view(torch.uint8).reshape(-1, scales)
    return b.reshape(n, f.row_bytes(k))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


# --- the kernel ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_linear_blocks_is_the_fp32_matmul_over_the_dequantized_weights_for_every_row_count(fmt, k, n):
    blocks = blocks_of(n, k, fmt, k * n)
    w = OPS.dequantize(blocks, fmt, k)
    assert same_bits(w, dequantize(blocks, fmt))
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(n))
    for threads in (1, 2):  # threads own whole 64-column blocks: the split changes no sum
        torch.set_num_threads(threads)
        alone = torch.cat([OPS.linear_blocks(x[r:r + 1], blocks, fmt) for r in range(x.shape[0])])
        assert same_bits(alone, torch.cat([OPS.linear(x[r:r + 1], w) for r in range(x.shape[0])])), (
            f"{fmt} K {k} N {n}, {threads} threads: a row alone is not ops.linear's over the dequantized weights")
        for m in ROWS:
            for start in {0, x.shape[0] - m}:
                rows = x[start:start + m]
                out = OPS.linear_blocks(rows, blocks, fmt)
                assert same_bits(out, OPS.linear(rows, w)), f"{fmt} K {k} N {n} M {m}: not ops.linear's bits"
                differ = [i for i in range(m) if not same_bits(out[i], alone[start + i])]
                assert not differ, (f"{fmt} K {k} N {n}: rows {differ} differ computed among {m} rows "
                                    f"({threads} threads)")


@pytest.mark.parametrize("fmt", FMTS)
def test_linear_blocks_on_every_byte_value_any_shape_and_layout(fmt):
    k, n = 128, 37
    blocks = random_bytes_blocks(n, k, fmt, 7)
    w = OPS.dequantize(blocks, fmt, k)
    assert same_bits(w, dequantize(blocks, fmt))
    x = torch.randn(3, 5, k, generator=torch.Generator().manual_seed(1))
    out = OPS.linear_blocks(x, blocks, fmt)  # x [..., K] -> [..., N]
    assert out.shape == (3, 5, n) and same_bits(out, OPS.linear(x, w))
    assert same_bits(OPS.linear_blocks(x.reshape(15, k), blocks, fmt), out.reshape(15, n))
    strided = torch.randn(k, 6).T  # a non-contiguous x: read as its values
    assert same_bits(OPS.linear_blocks(strided, blocks, fmt), OPS.linear(strided.contiguous(), w))
    assert same_bits(OPS.linear_blocks(x[0], blocks[1::2], fmt), OPS.linear(x[0], w[1::2]))  # every other row
    assert OPS.linear_blocks(torch.empty(0, k), blocks, fmt).shape == (0, n)


@pytest.mark.parametrize("call, said", [
    (lambda: OPS.linear_blocks(torch.randn(2, 64).bfloat16(), torch.zeros(3, 68, dtype=torch.uint8), "q8_0"),
     "x must be a float32 CPU tensor"),
    (lambda: OPS.linear_blocks(torch.randn(2, 64).double(), torch.zeros(3, 68, dtype=torch.uint8), "q8_0"),
     "x must be a float32 CPU tensor"),
    (lambda: OPS.linear_blocks(torch.randn(2, 64), torch.zeros(3, 68), "q8_0"),
     "blocks must be a CPU uint8 [N, bytes]"),
    (lambda: OPS.linear_blocks(torch.randn(2, 64), torch.zeros(204, dtype=torch.uint8), "q8_0"),
     "blocks must be a CPU uint8 [N, bytes]"),
    (lambda: OPS.linear_blocks(torch.randn(2, 48), torch.zeros(3, 51, dtype=torch.uint8), "q8_0"),
     "K must be a positive multiple of 32, got 48"),
    (lambda: OPS.linear_blocks(torch.randn(2, 0), torch.zeros(3, 0, dtype=torch.uint8), "q4_1"),
     "K must be a positive multiple of 32, got 0"),
    (lambda: OPS.linear_blocks(torch.randn(2, 64), torch.zeros(3, 70, dtype=torch.uint8), "q8_0"),
     "q8_0 rows of 64 weights take 68 bytes, not 70"),
    (lambda: OPS.linear_blocks(torch.randn(2, 64), torch.zeros(3, 40, dtype=torch.uint8), "q8_0"),
     "q8_0 rows of 64 weights take 68 bytes, not 40"),  # Q4_1 blocks read as Q8_0
    (lambda: OPS.linear_blocks(torch.randn(2, 64), torch.zeros(3, 68, dtype=torch.uint8), "q4_1"),
     "q4_1 rows of 64 weights take 40 bytes, not 68"),
    (lambda: OPS.linear_blocks(torch.randn(2, 64), torch.zeros(3, 68, dtype=torch.uint8), "q4_0"),
     "unknown block format q4_0: q8_0 or q4_1"),
    (lambda: OPS.dequantize(torch.zeros(3, 68, dtype=torch.uint8), "q8_0", 48),
     "K must be a positive multiple of 32, got 48"),
    (lambda: OPS.dequantize(torch.zeros(3, 68, dtype=torch.uint8), "q8_0", -64),
     "K must be a positive multiple of 32, got -64"),
    (lambda: OPS.dequantize(torch.zeros(3, 68, dtype=torch.uint8), "q8_0", 96),
     "q8_0 rows of 96 weights take 102 bytes, not 68"),
    (lambda: OPS.dequantize(torch.zeros(3, 68, dtype=torch.uint8), "Q8_0", 64), "unknown block format Q8_0"),
    (lambda: OPS.dequantize(torch.zeros(3, 68, dtype=torch.int8), "q8_0", 64), "blocks must be a CPU uint8 [N, bytes]"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_inputs_are_one_line_runtime_errors(call, said):
    with pytest.raises(RuntimeError) as caught:
        call()
    message = str(caught.value)
    assert said in message and "\n" not in message.strip(), message


# --- QuantLinear and QuantEmbedding ----------------------------------------------------------------------------


class Calls:
    """Wraps the ops' block functions (monkeypatched on the loaded module) to count which path a forward took."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        self.rows: list[int] = []
        for name in ("linear_blocks", "dequantize", "linear"):
            real = getattr(OPS, name)

            def counted(*args, _real=real, _name=name):
                self.names.append(_name)
                self.rows.append(args[0].shape[0])
                return _real(*args)

            monkeypatch.setattr(OPS, name, counted)

    def take(self) -> list[str]:
        names, self.names = self.names, []
        return names


def layers_for(fmt: str, k: int, n: int, seed: int) -> tuple[QuantLinear, Linear]:
    """A QuantLinear and shared.layers.Linear holding its dequantized weights (what the fp32 model computes)."""
    blocks = blocks_of(n, k, fmt, seed)
    dense = Linear(k, n)
    dense.weight.data = dequantize(blocks, fmt)
    return QuantLinear(blocks, fmt, k), dense


@pytest.mark.task("L16.3")
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("k,n", [(128, 67), (576, 130)])
def test_quant_linear_takes_the_kernel_for_few_rows_and_torchs_gemm_beyond_bitwise_the_fp32_linear(fmt, k, n,
                                                                                                      monkeypatch):
    quant, dense = layers_for(fmt, k, n, k + n)
    w = dense.weight.detach()
    calls = Calls(monkeypatch)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3))
    for m in ROWS:
        out = quant(x[:m])
        path = calls.take()
        if m <= cpu_ops.FEW_ROWS:
            assert path == ["linear_blocks"], f"M {m}: a decode's few rows take the block kernel, not {path}"
            expected = OPS.linear(x[:m], w)
        else:
            assert path == ["dequantize"], f"M {m}: a prefill's rows take torch's GEMM over the dequantized weights, " \
                                           f"not {path}"
            expected = F.linear(x[:m], w)
        assert same_bits(out, expected), f"{fmt} M {m}: not the fp32 product over the dequantized weights"
        assert same_bits(out, dense(x[:m])), f"{fmt} M {m}: not shared.layers.Linear's bits over those weights"
        calls.take()
    # the switch counts rows of any shape: [2, 8, K] is 16 rows, [3, 6, K] 18
    assert same_bits(quant(x[:16].reshape(2, 8, k)), dense(x[:16].reshape(2, 8, k)))
    assert calls.take()[0] == "linear_blocks"
    assert same_bits(quant(x[:18].reshape(3, 6, k)), dense(x[:18].reshape(3, 6, k)))
    assert calls.take()[0] == "dequantize"


@pytest.mark.task("L16.3")
@pytest.mark.parametrize("fmt", FMTS)
def test_every_row_takes_the_kernel_at_any_row_count_bitwise_l14s_matmul(fmt, monkeypatch):
    quant, dense = layers_for(fmt, 192, 70, 5)
    quant.every_row = True  # what L16Engine sets in L14's mode
    calls = Calls(monkeypatch)
    x = torch.randn(64, 192, generator=torch.Generator().manual_seed(4))
    out = quant(x)
    assert calls.take() == ["linear_blocks"]
    assert same_bits(out, OPS.linear(x, dense.weight.detach())), "L14's InvariantLinear computes ops.linear"
    calls.take()
    assert all(same_bits(out[r], quant(x[r:r + 1])[0]) for r in (0, 17, 63)), "a row alone = in 64"


@pytest.mark.task("L16.3")
@pytest.mark.parametrize("fmt", FMTS)
def test_without_the_ops_torch_runs_bitwise_the_fp32_linear_without_them(fmt, monkeypatch):
    quant, dense = layers_for(fmt, 128, 67, 6)
    calls = Calls(monkeypatch)
    monkeypatch.setenv(cpu_ops.ENABLE_VAR, "0")
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    for m in (1, 5, 16, 17, 64):
        assert same_bits(quant(x[:m]), dense(x[:m])), f"{fmt} M {m}, ops off"
        assert same_bits(quant(x[:m]), F.linear(x[:m], dense.weight.detach()))
    quant.every_row = True
    assert same_bits(quant(x[:3]), dense(x[:3]))
    assert calls.take() == [], "with $PAGED_COURSE_CPU_OPS=0 no C++ op runs"


@pytest.mark.task("L16.3")
@pytest.mark.parametrize("fmt", FMTS)
def test_the_embedding_dequantizes_only_the_rows_asked_for(fmt, monkeypatch):
    blocks = blocks_of(300, 64, fmt, 8)
    emb = QuantEmbedding(blocks, fmt, 64)
    ids = torch.tensor([0, 299, 7, 7, 150])
    expected = dequantize(blocks, fmt)[ids]
    calls = Calls(monkeypatch)
    out = emb(ids)
    assert calls.take() == ["dequantize"] and calls.rows[-1] == len(ids), "the rows' blocks, not the table's"
    assert out.dtype == torch.float32 and same_bits(out, expected)
    monkeypatch.setenv(cpu_ops.ENABLE_VAR, "0")
    assert same_bits(emb(ids), expected) and calls.take() == []


def test_a_quant_linear_holds_blocks_only_and_refuses_blocks_of_another_width():
    blocks = blocks_of(10, 64, "q4_1", 9)
    quant = QuantLinear(blocks, "q4_1", 64)
    assert quant.blocks is blocks and dict(quant.named_parameters()) == {}
    assert (quant.in_features, quant.out_features) == (64, 10) and "64 -> 10, q4_1" in repr(quant)
    assert quant.weight.numel() == 0 and quant.weight.dtype == torch.float32 and quant.weight.device.type == "cpu"
    with pytest.raises(ValueError, match=r"q8_0 blocks for rows of 64 weights: got torch.uint8 \[10, 40\]"):
        QuantLinear(blocks, "q8_0", 64)
    with pytest.raises(ValueError, match="float32"):
        QuantLinear(blocks.float(), "q4_1", 64)

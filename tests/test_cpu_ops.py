"""The decode step's C++ ops (shared/cpu_ops.cpp), the CPU path of every lesson's model.

- The few-row matmul is as accurate as torch's own product against float64 (fp32 and bf16, K with and without a
  tail), and each row's result is bitwise the same for every M from 1 to 130, at any place in x, on 1 or 2 threads.
- RoPE is torch's (and so HF's) to the bit; RMSNorm and SiLU-times-up are within torch's own error of float64.
- The model takes them for a decode step's few rows and torch's GEMM for a prefill's many; its logits stay within
  rounding of torch's path and its greedy tokens equal (parity itself is every lesson's own tests).
- Without a compiler one `note:` line, and torch runs: the same tokens.
- The AVX2 build (what a laptop without AVX-512 runs), built for haswell, keeps the same contract: tests/test_other_cpus.py
  runs this file's fast tests against it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared import cpu_ops
from shared.kernel_build import KernelUnavailable
from shared.layers import MLP, RMSNorm, RotaryEmbedding, _rotate
from shared.model import Qwen3ForCausalLM
from shared.tiny_qwen3 import default_model_dir

ROOT = Path(__file__).resolve().parents[1]
EXPECT_ISA = "CPU_OPS_EXPECT_ISA"  # set by tests/test_other_cpus.py for its AVX2 run of this file

try:
    OPS = cpu_ops.load_ops()
except KernelUnavailable as e:
    OPS = None
    WHY = str(e)
pytestmark = pytest.mark.skipif(OPS is None, reason=f"the C++ decode ops are unavailable: {WHY if OPS is None else ''}")

ROW_COUNTS = [1, 2, 3, 4, 5, 8, 15, 16, 17, 64, 130]  # tiles change at 4, the model's switch to torch after 16
SHAPES = [(576, 192), (128, 384), (77, 45), (1536, 64)]  # SmolLM2's and the tiny model's K; a ragged tail


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_build_is_the_one_asked_for():
    expected = os.environ.get(EXPECT_ISA)
    assert OPS.isa() in ("avx512+bf16", "avx512", "avx2", "portable")
    if expected:
        assert OPS.isa() == expected, f"built for {os.environ.get('PAGED_COURSE_MARCH')}, it runs {OPS.isa()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_linear_is_as_accurate_as_torchs_product(dtype, k, n, m):
    g = torch.Generator().manual_seed(k * n + m)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    exact = x.double() @ w.double().T  # the product of the very values both kernels see
    ours = (OPS.linear(x, w).double() - exact).abs().max().item()
    torchs = (F.linear(x, w).double() - exact).abs().max().item()
    # bf16 outputs round to 8 bits: both errors are mostly that rounding, and either can be the smaller one
    slack = 1e-6 if dtype == torch.float32 else exact.abs().max().item() * 2.0 ** -8
    assert ours <= 2 * torchs + slack, f"max error {ours:.3g} against torch's {torchs:.3g} (M={m}, K={k}, N={n})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,n", SHAPES[:3])
def test_linear_rows_are_bitwise_the_same_for_every_row_count_and_place(dtype, k, n):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(max(ROW_COUNTS), k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    alone = torch.cat([OPS.linear(x[r:r + 1], w) for r in range(x.shape[0])])
    for m in ROW_COUNTS:
        for start in (0, x.shape[0] - m):
            out = OPS.linear(x[start:start + m], w)
            for i in range(m):
                assert torch.equal(out[i], alone[start + i]), f"row {start + i} differs computed among {m} rows"
    torch.set_num_threads(2)  # threads own whole column blocks: the split changes no sum
    assert torch.equal(OPS.linear(x, w), alone), "two threads give other bits than one"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_is_torchs_to_the_bit(dtype, monkeypatch):
    rope = RotaryEmbedding(64, 1e6)
    x = torch.randn(7, 3, 64).to(dtype)
    cos, sin = rope.tables(torch.arange(100, 107), dtype)
    ours = _rotate(x, cos, sin)
    monkeypatch.setenv(cpu_ops.ENABLE_VAR, "0")
    assert torch.equal(ours, _rotate(x, cos, sin)), "the fused rotation rounds unlike torch's three ops"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_and_silu_mul_are_within_torchs_error(dtype, monkeypatch):
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576) + 0.5
    norm = norm.to(dtype)
    mlp = MLP(576, 64).to(dtype)
    x = torch.randn(5, 576).to(dtype)
    x64, w64 = x.double(), norm.weight.double()
    exact_norm = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    exact_silu = F.silu(gate.double()) * up.double()
    ours = (norm(x).double() - exact_norm).abs().max().item(), (OPS.silu_mul(gate, up).double() - exact_silu).abs().max().item()
    monkeypatch.setenv(cpu_ops.ENABLE_VAR, "0")
    torchs = (norm(x).double() - exact_norm).abs().max().item(), (F.silu(gate) * up).double().sub(exact_silu).abs().max().item()
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8
    for name, o, t, scale in (("RMSNorm", ours[0], torchs[0], exact_norm), ("silu * up", ours[1], torchs[1], exact_silu)):
        assert o <= 2 * t + 4 * ulp * scale.abs().max().item(), f"{name}: max error {o:.3g} against torch's {t:.3g}"


class SdpaKv:
    """Attention over just this step's keys (one causal prompt): enough to run the model without a pool."""

    def attend(self, layer, q, k, v, meta):
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [5, 40])
def test_the_model_takes_the_matmul_for_few_rows_only_and_stays_within_rounding(dtype, tokens, monkeypatch):
    model = Qwen3ForCausalLM.from_dir(default_model_dir(), dtype, torch.device("cpu"))
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    calls = []
    real = cpu_ops.load_ops()

    class Counting:  # the module, counting the matmul calls that reach it
        def __getattr__(self, name):
            return getattr(real, name)

        def linear(self, x, w):
            calls.append(x.shape[0])
            return real.linear(x, w)

    monkeypatch.setattr(cpu_ops, "_loaded", Counting())
    ours = model.logits(model(ids, torch.arange(tokens), SdpaKv(), None))
    layers = model.config.num_hidden_layers
    assert len(calls) == (7 * layers + 1 if tokens <= cpu_ops.FEW_ROWS else 0), (
        f"{tokens} rows: {len(calls)} matmuls took the C++ path (7 a layer and the LM head for at most "
        f"{cpu_ops.FEW_ROWS} rows, none above)")
    monkeypatch.setenv(cpu_ops.ENABLE_VAR, "0")
    torchs = model.logits(model(ids, torch.arange(tokens), SdpaKv(), None))
    bound = 1e-3 if dtype == torch.float32 else 0.5
    assert (ours - torchs).abs().max().item() < bound
    assert torch.equal(ours.argmax(-1), torchs.argmax(-1)) or dtype == torch.bfloat16


def test_without_a_compiler_one_note_and_torch_runs(tmp_path):
    env = {**os.environ, "CXX": "no-such-compiler", "PAGED_COURSE_CACHE": str(tmp_path)}
    code = ("import torch\nfrom shared.model import Qwen3ForCausalLM\nfrom shared.tiny_qwen3 import default_model_dir\n"
            "from test_cpu_ops import SdpaKv\n"
            "m = Qwen3ForCausalLM.from_dir(default_model_dir(), torch.float32, torch.device('cpu'))\n"
            "for t in (3, 1): print(m.logits(m(torch.arange(t), torch.arange(t), SdpaKv(), None)).argmax(-1).tolist())")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    notes = [line for line in run.stderr.splitlines() if line.startswith("note:")]
    assert notes == ["note: the C++ decode ops are unavailable (no C++ compiler (no-such-compiler) on PATH); torch "
                     "runs every op"], run.stderr

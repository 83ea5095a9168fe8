"""L3's C++ kernel on L12's int8 pages [N, S, Hkv, D + 4] (each row's D codes, then its fp32 scale), against the
dequantizing torch oracle (DequantTorchBackend: gather the history's rows, unpack_rows, causal attention in fp32).

Tolerances: fp32 q within 1e-5 of the oracle. Both read the same codes and scales and attend exactly; the
kernel scales a key's scores ((q . code) x scale) and a value's softmax weights ((w x scale) x code) where
the oracle multiplies the rows first (q . (code x scale)), so only the rounding order differs. bf16 and fp16 q
are compared with the oracle run in fp32 on the same (widened, so exact) q: the kernel computes in fp32 and
rounds once to q's dtype, half an ulp (relative 2^-9 for bf16, 2^-12 for fp16); rtol is one ulp (2^-8, 2^-11)
on top of the fp32 slack. Pools come from L3's test helper `batch`: random pages in random order from a pool
with spare blocks, every unwritten tail included; K and V are then scaled per token and head, so scales
differ across a page and across heads, and a kernel that reads a wrong row's scale is off by far more than 1e-5.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lessons.l3_block_tensor.backends import CppBackend, cpp_backend
from lessons.l3_block_tensor.backends.torch_backend import history_slots
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l12_kv_quant.backends import DequantTorchBackend
from lessons.l12_kv_quant.quantize import SCALE_BYTES, pack_rows, unpack_rows
from shared import kernel_build
from test_l3_cpp_backend import FP32_TOL, MIXED, ODD_HEAD_DIMS, batch, needs_kernel, run

# Columns of a plan's work item that say which KV-head chunk it is (tests/test_l3_cpp_plan.py names them all).
CHUNK, CHUNKS = 5, 6
LOW_PRECISION_TOL = {torch.bfloat16: {"atol": 2e-5, "rtol": 2.0**-8}, torch.float16: {"atol": 2e-5, "rtol": 2.0**-11}}
# Each kind alone: decodes (1 new row), whole prompts (every row new, causal among themselves), and slices (a
# chunk of new rows over a history already in the pool, as L8's chunked prefill feeds them): (history, new rows).
KINDS = {
    "decodes": [(1, 1), (200, 1), (16, 1), (401, 1), (3, 1)],
    "prompts": [(37, 37), (64, 64), (5, 5), (100, 100)],
    "slices": [(45, 9), (130, 17), (90, 33), (64, 32), (17, 16)],
}


def int8_batch(seed: int, s: int, hq: int, hkv: int, d: int, rows: list[tuple[int, int]], spread: float = 0.3):
    """L3's random batch with its K/V pool packed as int8 rows. Each (token, KV head) row is first multiplied by
    exp(spread x N(0, 1)), so row scales differ across tokens and heads by about e^(+-2 spread)."""
    meta, q, k, v = batch(seed=seed, s=s, hq=hq, hkv=hkv, d=d, rows=rows)
    g = torch.Generator().manual_seed(seed + 1)
    k = k * torch.exp(spread * torch.randn(*k.shape[:-1], 1, generator=g))
    v = v * torch.exp(spread * torch.randn(*v.shape[:-1], 1, generator=g))
    return meta, q, pack_rows(k), pack_rows(v)


def oracle(meta: BatchMeta, q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor) -> torch.Tensor:
    """The dequantizing oracle in fp32 (on q widened to fp32: bf16 and fp16 widen exactly)."""
    return run(DequantTorchBackend(), meta, q.float(), k8, v8)


def with_scales(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A copy of packed rows [..., D + 4] with their scales replaced by `scales` [..., 1] (fp32)."""
    out = rows.clone()
    out[..., -SCALE_BYTES:] = scales.float().contiguous().view(torch.int8)
    return out


def scales_of(rows: torch.Tensor) -> torch.Tensor:
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)


@needs_kernel
@pytest.mark.parametrize("s", [1, 7, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 4), (8, 1)])  # GQA groups 1, 2 and 8
@pytest.mark.parametrize("d", [64, 128])
def test_int8_pages_match_the_dequantizing_oracle_fp32(s: int, hq: int, hkv: int, d: int):
    # MIXED (L3's): ten requests in one call, decodes, whole prompts and slices interleaved.
    meta, q, k8, v8 = int8_batch(seed=s * 1000 + hq * 10 + hkv + d, s=s, hq=hq, hkv=hkv, d=d, rows=MIXED)
    assert k8.dtype == torch.int8 and k8.shape[-1] == d + SCALE_BYTES
    # The block table is random: the longest request's pages (MIXED's 401 tokens) are neither in order nor adjacent.
    longest = meta.kv_indices[int(meta.kv_indptr[8]):int(meta.kv_indptr[9])]
    assert not torch.equal(longest.sort().values, longest) and (longest.diff().abs() != 1).any()
    got = run(CppBackend(), meta, q, k8, v8)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, oracle(meta, q, k8, v8), **FP32_TOL)


@needs_kernel
@pytest.mark.parametrize("kind", list(KINDS))
def test_decodes_prompts_and_slices_each_match_the_oracle(kind: str):
    meta, q, k8, v8 = int8_batch(seed=len(kind), s=7, hq=8, hkv=2, d=64, rows=KINDS[kind])
    torch.testing.assert_close(run(CppBackend(), meta, q, k8, v8), oracle(meta, q, k8, v8), **FP32_TOL)


@needs_kernel
def test_the_oracle_is_l3s_oracle_on_the_dequantized_pool():
    # What the kernel is held to, checked once: dequantizing the whole pool and running L3's oracle is the same.
    from lessons.l3_block_tensor.backends.torch_backend import TorchBackend

    meta, q, k8, v8 = int8_batch(seed=4, s=7, hq=8, hkv=2, d=64, rows=MIXED)
    want = run(TorchBackend(), meta, q, unpack_rows(k8), unpack_rows(v8))
    assert torch.equal(oracle(meta, q, k8, v8), want)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s,hq,hkv,d", [(7, 8, 4, 64), (16, 8, 1, 128)])
def test_low_precision_q_over_int8_pages(dtype: torch.dtype, s: int, hq: int, hkv: int, d: int):
    meta, q, k8, v8 = int8_batch(seed=3 + s, s=s, hq=hq, hkv=hkv, d=d, rows=MIXED)
    q = q.to(dtype)
    got = run(CppBackend(), meta, q, k8, v8)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), oracle(meta, q, k8, v8), **LOW_PRECISION_TOL[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])  # one lane per decode row (1 x 8 scores), and groups of 4
@pytest.mark.parametrize("d", ODD_HEAD_DIMS)
def test_int8_pages_with_a_vector_tail_match_the_oracle(d: int, hq: int, hkv: int, dtype: torch.dtype):
    # L3's odd head dims (72, 80, 96, 120) on int8 rows of D + 4 bytes: the tail loop widens int8 codes too, and
    # each row's scale sits right after a row that is not a whole number of 32-float chunks.
    meta, q, k8, v8 = int8_batch(seed=d * 10 + hkv, s=7, hq=hq, hkv=hkv, d=d, rows=MIXED)
    q = q.to(dtype)
    got = run(CppBackend(), meta, q, k8, v8)
    assert got.shape == q.shape and got.dtype == dtype
    tol = FP32_TOL if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    torch.testing.assert_close(got.float(), oracle(meta, q, k8, v8), **tol)


@needs_kernel
@pytest.mark.parametrize("rows", [[(401, 1)], [(300, 1), (45, 9)]], ids=["one-decode", "decode-and-slice"])
def test_kv_head_chunks_split_over_two_threads(rows):
    # Fewer row tiles than threads: plan(threads=2) splits the KV heads into chunks, each item reading only its
    # heads' rows and scales. The same sums as the unsplit plan, bit for bit, run on one thread or two.
    meta, q, k8, v8 = int8_batch(seed=6, s=16, hq=8, hkv=4, d=64, rows=rows)
    kernel = cpp_backend.load_kernel()
    tables = (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, 16)
    whole, split = kernel.plan(*tables, 1), kernel.plan(*tables, 2)
    assert (whole[:, CHUNKS] == 1).all() and (split[:, CHUNKS] > 1).all()
    want = kernel.run_planned(q, k8, v8, meta.kv_indptr, meta.kv_indices, whole)
    torch.testing.assert_close(want, oracle(meta, q, k8, v8), **FP32_TOL)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(kernel.run_planned(q, k8, v8, meta.kv_indptr, meta.kv_indices, split), want)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_every_rows_own_scale_is_applied_to_keys_and_to_values():
    # Scales spread over e^(+-4) across tokens and heads, so values reach the thousands: fp32 sums are then off by a
    # few ulps of the largest value, and the tolerance is 2^-20 (8 ulps) of max |V| rather than 1e-5. The kernel
    # matches the oracle; each wrong way of reading scales (ignored, i.e. 1.0; keys' or values' alone ignored;
    # the page's first row's for every row; the other KV head's) moves the output by over 100x that tolerance.
    meta, q, k8, v8 = int8_batch(seed=8, s=7, hq=8, hkv=2, d=64, rows=MIXED, spread=2.0)
    want = oracle(meta, q, k8, v8)
    atol = 2.0**-20 * unpack_rows(v8).abs().max().item()
    torch.testing.assert_close(run(CppBackend(), meta, q, k8, v8), want, atol=atol, rtol=1e-5)
    k_scales, v_scales = scales_of(k8), scales_of(v8)
    assert k_scales.max() / k_scales.min() > 1000 and v_scales.max() / v_scales.min() > 1000
    ones = torch.ones_like(k_scales)
    wrong = {
        "keys' scales ignored": (with_scales(k8, ones), v8),
        "values' scales ignored": (k8, with_scales(v8, ones)),
        "each page's first row's scale": (with_scales(k8, k_scales[:, :1].expand_as(k_scales)),
                                          with_scales(v8, v_scales[:, :1].expand_as(v_scales))),
        "the other KV head's scale": (with_scales(k8, k_scales.flip(2)), with_scales(v8, v_scales.flip(2))),
    }
    for name, (k_wrong, v_wrong) in wrong.items():
        off = (oracle(meta, q, k_wrong, v_wrong) - want).abs().max().item()
        assert off > 100 * atol, f"{name}: only {off:.2g} from the right output (tolerance {atol:.2g})"


@needs_kernel
def test_spare_blocks_and_page_tails_are_never_read():
    # Every slot outside the batch's histories (spare blocks, the unwritten tail of each last page) holds codes
    # 127 and a NaN scale: a kernel that read one, even masked to weight 0 (NaN x 0 = NaN), would return NaN.
    s = 7
    meta, q, k8, v8 = int8_batch(seed=10, s=s, hq=8, hkv=2, d=64, rows=MIXED)
    used = torch.zeros(k8.shape[0] * s, dtype=torch.bool)
    for b in range(meta.batch_size):
        used[history_slots(meta, b)] = True
    assert (~used).sum() > s  # spare blocks and tails both
    for pool in (k8, v8):
        flat = pool.view(-1, *pool.shape[2:])  # [N * S, Hkv, D + 4], a view: writes reach the pool
        flat[~used, :, :-SCALE_BYTES] = 127
        flat[~used, :, -SCALE_BYTES:] = torch.full((1,), float("nan")).view(torch.int8)
    got = run(CppBackend(), meta, q, k8, v8)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, oracle(meta, q, k8, v8), **FP32_TOL)


@needs_kernel
def test_int8_pages_are_read_in_place():
    # The call allocates its output (q's size) and its plan, nothing the size of the history: no dequantized
    # copy of the pages is made. A dequantized fp32 copy of these histories' K alone would be ~30x the output.
    meta, q, k8, v8 = int8_batch(seed=12, s=16, hq=4, hkv=2, d=64, rows=[(401, 1), (300, 1), (130, 2)])
    kernel = cpp_backend.load_kernel()
    history_k_bytes = int(meta.kv_indptr[-1]) * 16 * 2 * 64 * 4
    assert history_k_bytes > 30 * q.nbytes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # allocations on the calling thread, where the profiler sees them
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = kernel.paged_attention(q, k8, v8, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                         meta.kv_last_page_len)
    finally:
        torch.set_num_threads(threads)
    allocated = sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0)
    assert out.nbytes <= allocated <= out.nbytes + 4096
    torch.testing.assert_close(out, oracle(meta, q, k8, v8), **FP32_TOL)
    # Control: the same measure sees a dequantized copy when one is made.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        unpack_rows(k8)
    assert sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0) > history_k_bytes


@needs_kernel
def test_int8_codes_widen_to_fp32_with_vector_instructions():
    """docs/l12_kv_quant.md's first pitfall. GCC 12 compiles the portable int8-to-fp32 widening (one
    __builtin_convertvector) into eight scalar loads and converts (vcvtsi2ss): int8 decode attention took 2.9x
    bf16's time. Where the build has AVX2, load8 sign-extends and converts with intrinsics, so the kernel's machine
    code holds vpmovsxbd (eight bytes to eight int32 lanes, one instruction). The cause is checked, not a timing."""
    library = Path(cpp_backend.load_kernel().__file__)
    flags = next((f for f in kernel_build.FLAGS if kernel_build.library(kernel_build.build_dir(f, cpp_backend.SOURCE), cpp_backend.SOURCE) == library), None)
    if platform.machine() not in ("x86_64", "AMD64") or flags is None or shutil.which("objdump") is None:
        pytest.skip("needs an x86-64 build of the kernel from its cache, and objdump")
    compiler = os.environ.get("CXX", "c++")
    macros = subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True,
                            check=True, timeout=60).stdout
    if "#define __AVX2__ 1" not in macros.splitlines():
        pytest.skip(f"the kernel was built without AVX2 ({' '.join(flags)}): load8 takes its portable path")
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                          check=True, timeout=120).stdout
    scalar = dump.count("vcvtsi2ss")
    assert "vpmovsxbd" in dump, (
        f"the kernel ({' '.join(flags)}, AVX2) holds no vpmovsxbd and {scalar} scalar int-to-float converts "
        "(vcvtsi2ss): load8(const int8_t*) does not widen int8 codes with the AVX2 intrinsics, the path that "
        "keeps int8 decode attention no slower than bf16's")


@needs_kernel
@pytest.mark.parametrize("width", [64 + 3, 64, 64 + 8])
def test_an_int8_row_of_the_wrong_width_is_one_error_naming_head_dim(width: int):
    meta, q, k8, v8 = int8_batch(seed=1, s=4, hq=4, hkv=2, d=64, rows=[(9, 1)])
    k_bad = torch.zeros(*k8.shape[:-1], width, dtype=torch.int8)
    kernel = cpp_backend.load_kernel()
    with pytest.raises(RuntimeError) as e:
        kernel.paged_attention(q, k_bad, k_bad.clone(), meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                               meta.kv_last_page_len)
    assert str(e.value).splitlines()[0] == (f"head_dim: q has 64, so the pool's rows need 68 elements (int8 codes "
                                            f"and a 4-byte scale), it has {width}")


@needs_kernel
def test_a_float_pool_with_scale_wide_rows_is_an_error():
    # Only int8 pages carry a scale: an fp32 pool's rows are D wide, and D + 4 is a shape error, not scaled rows.
    meta, q, k8, v8 = int8_batch(seed=1, s=4, hq=4, hkv=2, d=64, rows=[(9, 1)])
    k_float = torch.zeros(k8.shape)
    with pytest.raises(RuntimeError, match="head_dim: q has 64, so the pool's rows need 64 elements, it has 68"):
        cpp_backend.load_kernel().paged_attention(q, k_float, k_float.clone(), meta.qo_indptr, meta.kv_indptr,
                                                  meta.kv_indices, meta.kv_last_page_len)


@needs_kernel
@pytest.mark.parametrize("v_dtype", [torch.bfloat16, torch.float32])
def test_int8_keys_with_float_values_is_an_error(v_dtype: torch.dtype):
    meta, q, k8, v8 = int8_batch(seed=1, s=4, hq=4, hkv=2, d=64, rows=[(9, 1)])
    with pytest.raises(RuntimeError, match="k_cache and v_cache must share a dtype"):
        cpp_backend.load_kernel().paged_attention(q, k8, v8.to(v_dtype), meta.qo_indptr, meta.kv_indptr,
                                                  meta.kv_indices, meta.kv_last_page_len)

"""The C++ kernels as an AVX2 laptop builds them, on any x86-64 machine: L3's attention kernel and L14's ops built
with -march=haswell (AVX2 and FMA, no AVX-512) into a scratch cache ($PAGED_COURSE_MARCH, $PAGED_COURSE_CACHE),
then held to their own tests (the torch oracles, L14's bit-for-bit claims) in a child pytest whose torch runs its
AVX2 kernels too. On the developers' AVX-512 machines -march=native compiles another program (EVEX instructions,
other branches); without these tests the AVX2 one would first run on a learner's laptop. docs/maintainers.md,
"Other CPUs", says how to run the whole suite the same way, and under an emulated AVX2 CPU.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lessons.l3_block_tensor.backends import cpp_backend
from shared import cpu_ops, kernel_build
from test_l3_cpp_backend import ROOT, needs_kernel

x86_64 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                            reason=f"-march=haswell is an x86-64 CPU; this machine is {platform.machine()}")
runs_haswell = pytest.mark.skipif(not {"avx2", "fma"} <= set(kernel_build.cpu_features().split()),
                                  reason="runs haswell code: needs a CPU whose /proc/cpuinfo lists avx2 and fma")
# torch's own kernels as on an AVX2 laptop too (ATen's, oneDNN's, MKL's: each picks its ISA at run time), so the
# oracles' arithmetic is the laptop's. MKL's matters: torch.exp here is MKL's, 1 ulp apart on 105 of 2,304 values.
TORCH_AS_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
needs_objdump = pytest.mark.skipif(shutil.which("objdump") is None, reason="reads the builds with objdump (binutils)")
# An instruction whose first opcode byte is 0x62, after any segment or address-size prefix: in 64-bit mode that
# is EVEX, AVX-512's encoding, whatever the register width. -march=native on a Sapphire Rapids box keeps 256-bit
# vectors (no zmm register appears) yet uses ~600 EVEX-only instructions (masks, vpermt2ps) in L3's kernel.
EVEX = re.compile(r"^\s*[0-9a-f]+:\t(?:(?:2e|3e|64|65|67) )*62 ", re.MULTILINE)
# Each test took 26-31 s on a 2-core Sapphire Rapids box (a build, then its tests); a busy box builds slower.
CHILD_TIMEOUT_S = 1200


def evex_instructions(binary: Path) -> int:
    """How many AVX-512 (EVEX-encoded) instructions `binary` holds."""
    dump = subprocess.run(["objdump", "-d", "--insn-width=16", str(binary)], capture_output=True, text=True,
                          check=True, timeout=120).stdout
    return len(EVEX.findall(dump))


@pytest.fixture(scope="module")
def haswell_cache(tmp_path_factory) -> Path:
    """One scratch cache for both tests: L14's tests load L3's kernel too, built once."""
    return tmp_path_factory.mktemp("haswell-cache")


def run_as_haswell(cache: Path, files: list[str]) -> None:
    """The files' fast tests in a child pytest that builds and loads the kernels for haswell; every one passes,
    none skips (a kernel that did not build skips its tests, which would pass here unseen)."""
    env = {**os.environ, **TORCH_AS_AVX2, kernel_build.MARCH_VAR: "haswell", "PAGED_COURSE_CACHE": str(cache),
           "CPU_OPS_EXPECT_ISA": "avx2"}  # tests/test_cpu_ops.py: the ops must report their 8-lane AVX2 paths
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID", "PYTEST_ADDOPTS"):  # the child is a session
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *files],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0, f"{files} as haswell: {summary}\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}"
    assert " passed" in summary and "skipped" not in summary, f"{files} as haswell: {summary}\n{r.stdout[-3000:]}"


def assert_built_for_haswell(cache: Path, source: Path) -> None:
    """The build the child loaded is the haswell one, alone in the cache, and holds no AVX-512 instruction."""
    haswell = kernel_build.flag_sets("haswell")[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_build, "cache_root", lambda: cache)
        folder = kernel_build.build_dir(haswell, source)
    built = sorted(p.name for p in (cache / "kernels").glob(f"{kernel_build.module_name(source)}-*") if p.is_dir())
    assert built == [folder.name], f"expected only the haswell build {folder.name}, found {built}"
    assert "-march=haswell" in (folder / "build.ninja").read_text()
    if shutil.which("objdump"):
        library = kernel_build.library(folder, source)
        assert evex_instructions(library) == 0, f"{library} holds AVX-512 instructions"


@pytest.mark.slow  # a kernel build and two test files: 31 s on a 2-core box
@needs_kernel
@x86_64
@runs_haswell
def test_the_avx2_build_of_the_attention_kernel_matches_the_oracle(haswell_cache):
    # fp32 and bf16 pages against TorchBackend (odd head dims: the vector loops' tails), int8 pages (L12: the
    # kernel's one __AVX2__ branch, its int8 widening) against the dequantizing oracle
    run_as_haswell(haswell_cache, ["tests/test_l3_cpp_backend.py", "tests/test_l12_kernel.py"])
    assert_built_for_haswell(haswell_cache, cpp_backend.SOURCE)


@pytest.mark.slow  # the decode ops' build and L14's and their own tests (L3's kernel builds too if the test above did not run)
@needs_kernel
@x86_64
@runs_haswell
def test_the_avx2_build_of_l14s_ops_keeps_its_bit_for_bit_claims(haswell_cache):
    # the __FMA__ branch: rows bitwise the same for any batch, thread count and place; RMSNorm HF's arithmetic;
    # L3's kernel bitwise the same whole, sliced, decoded and in a crowd; and the decode ops' own contract (every
    # model's CPU matmul, norms, RoPE: accuracy against float64, rows bitwise the same at M 1..130, RoPE torch's bits),
    # and L16's block kernel (its __AVX2__ Q8_0/Q4_1 loads and F16C scales): bitwise that matmul over the dequantized
    # weights at every row count, its dequantize the torch reference's bits
    run_as_haswell(haswell_cache, ["tests/test_l14_ops.py", "tests/test_cpu_ops.py", "tests/test_l16_kernel.py"])
    assert_built_for_haswell(haswell_cache, cpu_ops.SOURCE)  # L14's ops are the shared decode ops
    assert_built_for_haswell(haswell_cache, cpp_backend.SOURCE)


@needs_kernel  # a compiler; under a second
@needs_objdump
@x86_64
def test_the_evex_count_sees_avx512_code(tmp_path):
    # A count that sees none would pass any build: one AVX-512 add is counted, one AVX2 add is not.
    compiler = os.environ.get("CXX", "c++")
    counts = []
    for flags, body in ((["-mavx512f"], "__m512 f(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }"),
                        (["-march=haswell"], "__m256 f(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }")):
        source, obj = tmp_path / "add.cpp", tmp_path / "add.o"
        source.write_text(f"#include <immintrin.h>\n{body}\n")
        subprocess.run([compiler, "-O2", "-c", *flags, str(source), "-o", str(obj)], check=True, timeout=120)
        counts.append(evex_instructions(obj))
    assert counts[0] >= 1 and counts[1] == 0, counts

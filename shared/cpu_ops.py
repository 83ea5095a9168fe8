"""The decode step's C++ ops on the CPU (cpu_ops.cpp): which calls of a step they take, and when torch keeps them.

Built on first use into the course's cache folder (shared/kernel_build.py, about a minute) and loaded from there
afterwards. Every lesson's model asks `ops_for(x)` before a matmul, a norm, RoPE or SiLU: the module when x is a
CPU tensor in fp32 or bf16 and the build succeeded, None otherwise (a GPU tensor, fp16, no compiler: torch runs,
after one `note:` line). `PAGED_COURSE_CPU_OPS=0` turns them off: what a benchmark's baseline and L14's default
mode without them use.

The matmul takes a decode step's few rows (at most FEW_ROWS): there it streams each weight once at the memory rate,
where torch's one-row product reaches about 40% of it. A prefill's many rows stay with torch's GEMM, faster there;
L14's mode uses the same matmul for every row count, so its rows are computed one way whatever the batch.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from shared.kernel_build import KernelUnavailable, build_and_load

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
ENABLE_VAR = "PAGED_COURSE_CPU_OPS"
FEW_ROWS = 16  # a matmul of at most this many rows is ours: decode steps, verify rows, short chunks
DTYPES = (torch.float32, torch.bfloat16)

_loaded: ModuleType | None = None
_failure: str | None = None


def enabled() -> bool:
    """False when $PAGED_COURSE_CPU_OPS is 0 (torch for every op); read each call, so a test can flip it."""
    return os.environ.get(ENABLE_VAR, "1").strip() != "0"


def load_ops() -> ModuleType:
    """The compiled module (built the first time, in this process or an earlier one). Raises KernelUnavailable."""
    global _loaded, _failure
    if _loaded is None and _failure is None:
        try:
            _loaded = build_and_load(SOURCE)
        except KernelUnavailable as e:
            _failure = str(e)
            print(f"note: the C++ decode ops are unavailable ({e}); torch runs every op", file=sys.stderr, flush=True)
    if _loaded is None:
        raise KernelUnavailable(_failure)
    return _loaded


def ops_for(x: torch.Tensor) -> ModuleType | None:
    """The C++ ops for this tensor, or None where torch runs it."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or not enabled():
        return None
    try:
        return load_ops()
    except KernelUnavailable:
        return None

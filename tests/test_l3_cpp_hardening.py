"""The C++ kernel as a neighbour (paged_attention.cpp, cpp_backend.py): it lets other Python threads run while it
computes, and turns a bad shape into an error rather than a dead process.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lessons.l3_block_tensor.backends import cpp_backend

ROOT = Path(__file__).resolve().parents[1]

try:
    cpp_backend.load_kernel()
    UNAVAILABLE = None
except cpp_backend.KernelUnavailable as e:
    UNAVAILABLE = str(e)
needs_kernel = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"the C++ kernel is unavailable: {UNAVAILABLE}")


def one_request(history: int, rows: int, s: int, hq: int, hkv: int, d: int):
    """One request feeding `rows` new tokens over `history` tokens, its pages blocks 0, 1, ... in order."""
    pages = -(-history // s)
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    k = torch.randn(pages, s, hkv, d)
    v = torch.randn(pages, s, hkv, d)
    q = torch.randn(rows, hq, d)
    last_page_len = history - (pages - 1) * s
    return q, k, v, i32([0, rows]), i32([0, pages]), torch.arange(pages, dtype=torch.int32), i32([last_page_len])


@needs_kernel
def test_other_python_threads_run_while_the_kernel_computes():
    # A server's event loop (SSE writes, /health, new requests) is another Python thread: it must not stop for
    # the length of an attention call. 64 rows over a 32k history take ~0.6 s on one thread of a 2-core Zen3,
    # so a thread that wakes every millisecond gets hundreds of turns, and none while the kernel holds the GIL.
    kernel = cpp_backend.load_kernel()
    args = one_request(history=32768, rows=64, s=16, hq=16, hkv=2, d=128)
    ticks, stop = [0], threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            time.sleep(0.001)
            ticks[0] += 1

    thread = threading.Thread(target=ticker)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    thread.start()
    try:
        time.sleep(0.02)
        before = ticks[0]
        kernel.paged_attention(*args)
        during = ticks[0] - before
    finally:
        stop.set()
        thread.join()
        torch.set_num_threads(threads)
    assert during > 5, f"the ticker ran {during} time(s) during the kernel call"


# Run in a child process: a division by zero there is a signal that kills the child, not the test session.
ZERO_KV_HEADS = """
import torch
from lessons.l3_block_tensor.backends import cpp_backend
i32 = lambda values: torch.tensor(values, dtype=torch.int32)
k = torch.zeros(2, 4, 0, 64)
try:
    cpp_backend.load_kernel().paged_attention(torch.zeros(1, 4, 64), k, k.clone(), i32([0, 1]), i32([0, 1]), i32([0]),
                                              i32([1]))
except RuntimeError as e:
    print(str(e).splitlines()[0])
"""


@needs_kernel
def test_a_pool_with_no_kv_heads_is_an_error_not_a_crash():
    r = subprocess.run([sys.executable, "-c", ZERO_KV_HEADS], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-500:]}"
    assert r.stdout.strip() == "Hq (4) must be a positive multiple of Hkv (0)"


@needs_kernel
@pytest.mark.parametrize("q_shape,k_shape,message", [
    ((1, 6, 64), (2, 4, 4, 64), r"^Hq \(6\) must be a positive multiple of Hkv \(4\)"),
    ((1, 4, 64), (2, 4, 2, 32), r"^head_dim: q has 64, the pool 32"),
    ((1, 4, 12), (2, 4, 2, 12), r"^head_dim must be a positive multiple of 8, got 12"),
    ((1, 4, 64), (2, 0, 2, 64), r"^block size must be at least 1, got 0"),
])
def test_a_bad_shape_is_one_clear_error(q_shape, k_shape, message):
    q, k = torch.zeros(q_shape), torch.zeros(k_shape)
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    with pytest.raises(RuntimeError, match=message):
        cpp_backend.load_kernel().paged_attention(q, k, k.clone(), i32([0, 1]), i32([0, 1]), i32([0]), i32([1]))

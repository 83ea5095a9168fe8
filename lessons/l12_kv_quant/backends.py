"""Attention over quantized pages. The C++ kernel (L3's, taught int8 here) reads the codes and their scales in
place; the torch oracle gathers a request's rows, dequantizes them, and attends in fp32: slow and obviously
right, what the kernel is tested against."""
from __future__ import annotations

import sys

import torch

from lessons.l3_block_tensor.backends import AttentionBackend, CppBackend, TorchBackend
from lessons.l3_block_tensor.backends.cpp_backend import KernelUnavailable
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l12_kv_quant.quantize import unpack_rows
from shared.attention import causal_attention
from shared.errors import CourseError

_said_why_not_cpp = False


class DequantTorchBackend(TorchBackend):
    """L3's oracle with one step added: the gathered int8 rows are dequantized before attention."""

    # Task L12.4: the oracle: gather each request's rows by slot, unpack them, attend in fp32
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        if meta is not self._planned:  # a stale plan would silently attend over last step's pages
            raise RuntimeError("run() called with metadata that was not planned: call plan(meta) first")
        k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [N*S, Hkv, D + 4] views, no copy
        outs = [causal_attention(q[q0:q1].float(), unpack_rows(k_flat[slots]), unpack_rows(v_flat[slots]))
                for q0, q1, slots in self._per_request]
        return torch.cat(outs).to(q.dtype)


def int8_backend(name: str, device: torch.device) -> AttentionBackend:
    """cpp (the default on the CPU) or the torch oracle. Nothing else reads these pages: the batched backend
    would dequantize every gathered page into a copy, and FlashInfer's quantized pages are fp8."""
    global _said_why_not_cpp
    if name == "torch":
        return DequantTorchBackend()
    if name not in ("auto", "cpp"):
        raise CourseError(f"--kv-dtype int8 runs on the C++ kernel (--backend cpp) or the torch oracle "
                          f"(--backend torch), not --backend {name}")
    if device.type != "cpu":
        raise CourseError(f"--kv-dtype int8 pages are read by the C++ CPU kernel; on {device.type} use --kv-dtype fp8")
    try:
        return CppBackend()
    except KernelUnavailable as e:
        if name == "cpp":
            raise CourseError(f"--backend cpp cannot run: {e}") from None
        if not _said_why_not_cpp:
            print(f"note: the C++ attention kernel is unavailable ({e}); int8 pages are read by the torch oracle",
                  file=sys.stderr)
            _said_why_not_cpp = True
        return DequantTorchBackend()

"""Pick an attention backend: FlashInfer's kernels on CUDA, the C++ kernel on the CPU, the batched torch path
where neither can run.

The torch oracle (a plain loop over requests) is never picked by `auto`: it is what the others are tested against."""
from __future__ import annotations

import sys

import torch

from lessons.l3_block_tensor.backends.base import AttentionBackend
from lessons.l3_block_tensor.backends.batched_backend import BatchedBackend
from lessons.l3_block_tensor.backends.cpp_backend import CppBackend, KernelUnavailable
from lessons.l3_block_tensor.backends.flashinfer_args import unsupported_reason
from lessons.l3_block_tensor.backends.torch_backend import TorchBackend
from shared.config import Qwen3Config
from shared.errors import CourseError

BACKENDS = ("auto", "flashinfer", "cpp", "batched", "torch")
_said_why_not_cpp = False  # auto's fallback from the C++ kernel is said once per process, not per engine


def make_backend(name: str, cfg: Qwen3Config, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    """auto = flashinfer where it can run (CUDA, installed, fp16/bf16, a supported head_dim), else the C++
    kernel on the CPU (where it builds), else batched."""
    if name not in BACKENDS:
        raise CourseError(f"unknown backend {name!r}: use one of {', '.join(BACKENDS)}")
    if name == "torch":
        return TorchBackend()
    if name == "batched":
        return BatchedBackend()
    if name == "cpp" or (name == "auto" and device.type == "cpu"):
        return _cpp_backend(device, fall_back=name == "auto")
    reason = unsupported_reason(cfg, dtype, device)
    if name == "auto" and reason is not None:
        return BatchedBackend()
    if reason is not None:
        raise CourseError(f"--backend flashinfer cannot run: {reason}")
    from lessons.l3_block_tensor.backends.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(cfg, dtype, device)


def _cpp_backend(device: torch.device, fall_back: bool) -> AttentionBackend:
    global _said_why_not_cpp
    if device.type != "cpu":
        raise CourseError(f"--backend cpp runs on the CPU; this run is on {device.type}")
    try:
        return CppBackend()
    except KernelUnavailable as e:
        if not fall_back:
            raise CourseError(f"--backend cpp cannot run: {e}") from None
        if not _said_why_not_cpp:
            print(f"note: the C++ attention kernel is unavailable ({e}); using the batched backend", file=sys.stderr)
            _said_why_not_cpp = True
        return BatchedBackend()


__all__ = ["AttentionBackend", "BACKENDS", "BatchedBackend", "CppBackend", "TorchBackend", "make_backend"]

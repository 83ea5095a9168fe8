"""Pick an attention backend: FlashInfer's kernels on CUDA, the batched torch path everywhere else.

The torch oracle (a plain loop over requests) is never picked by `auto`: it is what the others are tested against."""
from __future__ import annotations

import torch

from lessons.l3_block_tensor.backends.base import AttentionBackend
from lessons.l3_block_tensor.backends.batched_backend import BatchedBackend
from lessons.l3_block_tensor.backends.flashinfer_args import unsupported_reason
from lessons.l3_block_tensor.backends.torch_backend import TorchBackend
from shared.config import Qwen3Config
from shared.errors import CourseError

BACKENDS = ("auto", "flashinfer", "batched", "torch")


def make_backend(name: str, cfg: Qwen3Config, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    """auto = flashinfer where it can run (CUDA, installed, fp16/bf16, a supported head_dim), else batched."""
    if name not in BACKENDS:
        raise CourseError(f"unknown backend {name!r}: use one of {', '.join(BACKENDS)}")
    if name == "torch":
        return TorchBackend()
    reason = unsupported_reason(cfg, dtype, device)
    if name == "batched" or (name == "auto" and reason is not None):
        return BatchedBackend()
    if reason is not None:
        raise CourseError(f"--backend flashinfer cannot run: {reason}")
    from lessons.l3_block_tensor.backends.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(cfg, dtype, device)


__all__ = ["AttentionBackend", "BACKENDS", "BatchedBackend", "TorchBackend", "make_backend"]

"""The exact keyword arguments the FlashInfer backend passes, as pure functions of the step's metadata.

The backend calls these, and so does tests/test_l3_flashinfer_contract.py, which binds them to the
installed FlashInfer's signatures. No GPU was lent to this project: that binding is what guards the
CUDA path against API drift. Nothing here imports flashinfer.
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch

from lessons.l3_block_tensor.batch_meta import BatchMeta
from shared.config import Qwen3Config

WORKSPACE_BYTES = 128 * 1024 * 1024  # one float workspace, shared by both wrappers (one runs per step)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer rejects fp32
HEAD_DIMS = (64, 128, 256)  # dispatched by both prefill and decode
PLAIN_DECODE_GQA = (1, 2, 3, 4, 6, 8, 16)  # group sizes the decode kernel has without tensor cores


def unsupported_reason(cfg: Qwen3Config, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why FlashInfer cannot run this model here, or None when it can."""
    if device.type != "cuda":
        return f"FlashInfer needs a CUDA device; this run is on {device.type}"
    if importlib.util.find_spec("flashinfer") is None:
        return "FlashInfer is not installed (pip install flashinfer-python)"
    if dtype not in KERNEL_DTYPES:
        return f"FlashInfer kernels take float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if cfg.head_dim not in HEAD_DIMS:
        return f"FlashInfer has no kernel for head_dim {cfg.head_dim} (supported: {HEAD_DIMS})"
    return None


def use_tensor_cores(cfg: Qwen3Config) -> bool:
    # Wide query groups run faster on the prefill-style tensor-core kernel; odd ones (40/8 = 5) need it.
    return cfg.gqa_ratio >= 4 or cfg.gqa_ratio not in PLAIN_DECODE_GQA


def prefill_init_kwargs(workspace: torch.Tensor) -> dict[str, Any]:
    return {"float_workspace_buffer": workspace, "kv_layout": "NHD"}


def decode_init_kwargs(workspace: torch.Tensor, cfg: Qwen3Config) -> dict[str, Any]:
    return {"float_workspace_buffer": workspace, "kv_layout": "NHD", "use_tensor_cores": use_tensor_cores(cfg)}


def prefill_plan_kwargs(meta: BatchMeta, cfg: Qwen3Config, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "qo_indptr": meta.qo_indptr,
        "paged_kv_indptr": meta.kv_indptr,
        "paged_kv_indices": meta.kv_indices,
        "paged_kv_last_page_len": meta.kv_last_page_len,
        "num_qo_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim_qk": cfg.head_dim,
        "page_size": meta.block_size,
        "causal": True,  # the default is False: a prefill without it lets tokens see their future
        "pos_encoding_mode": "NONE",  # RoPE was applied before the cache write
        "q_data_type": dtype,  # the default is float16: bf16 q would fail at run()
        "kv_data_type": dtype,
    }


def decode_plan_kwargs(meta: BatchMeta, cfg: Qwen3Config, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "indptr": meta.kv_indptr,
        "indices": meta.kv_indices,
        "last_page_len": meta.kv_last_page_len,
        "num_qo_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "page_size": meta.block_size,
        "pos_encoding_mode": "NONE",
        "q_data_type": dtype,
        "kv_data_type": dtype,
    }


def run_kwargs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict[str, Any]:
    # One tuple (K pages, V pages) per layer, each [N, S, Hkv, D]: NHD, identical strides.
    return {"q": q, "paged_kv_cache": (k_cache, v_cache)}

"""fp8 KV pages, the CUDA path: FlashInfer reads float8_e4m3fn pages with one scale per layer for K and one for V.

The format is the one the big engines ship (vLLM's `kv_cache_dtype="fp8"`): every stored value is
fp8(x / scale), and attention multiplies the scale back. FlashInfer defines where (flashinfer-python 0.7.2.post1,
decode.py and prefill.py, the paged wrappers' `run`): `k_scale` multiplies the softmax scale, so it scales every
score q.k, and `v_scale` multiplies the output, after the softmax: both are Python floats, one per call, so one
per layer here. q stays in the model's dtype (bf16 or fp16): `plan` says so with q_data_type, and the pages'
dtype with kv_data_type=torch.float8_e4m3fn.

The scales are fixed at 1.0, vLLM's default: e4m3 keeps 3 mantissa bits from 2^-6 up to 448, and the embedded
model's K and V lie between about 0.01 and 11 (99% of them above 2^-6), so no calibration is needed and nothing
has to be measured on a first forward (which, under L7's graph capture, would be a dummy batch). A scale per
token would be int8's design; fp8 spends no bytes on scales: a row is D bytes.

On the CPU the torch oracle reads the same pages (e4m3 casts work on CPU tensors): it gathers a request's rows,
widens them to fp32, multiplies the scales back and attends. The C++ kernel reads int8 rows, not these.
Never run on a GPU in this project: written against FlashInfer's source and guarded by tests/test_l12_fp8.py,
which binds the exact arguments below to FlashInfer's signatures. FlashInfer is imported on CUDA only.
"""
from __future__ import annotations

import math
import sys
from typing import Any

import torch

from lessons.l3_block_tensor.backends import AttentionBackend, TorchBackend
from lessons.l3_block_tensor.backends import flashinfer_args as fa
from lessons.l3_block_tensor.backends.flashinfer_backend import FlashInferBackend
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l3_block_tensor.kv_pool import BlockKvPool
from shared.attention import causal_attention
from shared.config import Qwen3Config
from shared.errors import CourseError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3fn has no infinity, so larger values are clamped, never cast
DEFAULT_SCALE = 1.0  # vLLM's default k_scale / v_scale when none is calibrated

_said_why_not_flashinfer = False


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as e4m3, clamped first: an outlier saturates at +-448 whatever a device's cast does past the
    largest finite value (e4m3fn has no infinity; its only code above 448 is NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def from_fp8(codes: torch.Tensor, scale: float) -> torch.Tensor:
    return codes.float() * scale


class Fp8KvPool(BlockKvPool):
    """L3's pool in e4m3: per layer K and V [N, S, Hkv, D] float8_e4m3fn, and one float scale per layer for K and
    one for V. The scales belong to the layer, not to a block, so copy-on-write, swap and the followers' copies
    move bytes only, as for any dtype."""

    def __init__(self, cfg: Qwen3Config, num_blocks: int, block_size: int, device: torch.device,
                 scale: float = DEFAULT_SCALE):
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise CourseError(f"an fp8 scale must be a positive finite number, got {scale!r}")
        super().__init__(cfg, num_blocks, block_size, FP8, device)
        self.k_scale = [float(scale)] * cfg.num_hidden_layers
        self.v_scale = [float(scale)] * cfg.num_hidden_layers
        # Backends get a layer's page tensors, not its number: the tensor's identity says which layer it is.
        self._layer_of = {id(t): layer for layer, t in enumerate(self.k)}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v [T, Hkv, D] in the model's dtype -> e4m3 values at flat slots [T] (L2's slot convention)."""
        hkv, d = k.shape[1], k.shape[2]
        self.k[layer].view(-1, hkv, d)[slot_mapping] = to_fp8(k, self.k_scale[layer])
        self.v[layer].view(-1, hkv, d)[slot_mapping] = to_fp8(v, self.v_scale[layer])

    def scales(self, k_cache: torch.Tensor) -> tuple[float, float]:
        """(k_scale, v_scale) of the layer whose K pages are k_cache."""
        layer = self._layer_of.get(id(k_cache))
        if layer is None or self.k[layer] is not k_cache:
            raise RuntimeError("these K pages are not one of this pool's layers: pass pool.k[layer] itself")
        return self.k_scale[layer], self.v_scale[layer]


class Fp8TorchBackend(TorchBackend):
    """The oracle: L3's torch backend over e4m3 pages, each gathered row widened and multiplied by its layer's
    scale before attention in fp32. What FlashInfer computes, written the slow and obvious way."""

    name = "torch"

    def __init__(self, pool: Fp8KvPool):
        super().__init__()
        self.pool = pool

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        if meta is not self._planned:  # a stale plan would silently attend over last step's pages
            raise RuntimeError("run() called with metadata that was not planned: call plan(meta) first")
        k_scale, v_scale = self.pool.scales(k_cache)
        k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [N*S, Hkv, D] views, no copy
        outs = [causal_attention(q[q0:q1].float(), from_fp8(k_flat[slots], k_scale), from_fp8(v_flat[slots], v_scale))
                for q0, q1, slots in self._per_request]
        return torch.cat(outs).to(q.dtype)


# The exact keyword arguments the FlashInfer fp8 backend passes: L3's, with the pages' dtype and the scales.
# tests/test_l12_fp8.py binds them to FlashInfer's signatures.

def prefill_plan_kwargs(meta: BatchMeta, cfg: Qwen3Config, q_dtype: torch.dtype) -> dict[str, Any]:
    return {**fa.prefill_plan_kwargs(meta, cfg, q_dtype), "kv_data_type": FP8}  # q and the output: q_dtype


def decode_plan_kwargs(meta: BatchMeta, cfg: Qwen3Config, q_dtype: torch.dtype) -> dict[str, Any]:
    return {**fa.decode_plan_kwargs(meta, cfg, q_dtype), "kv_data_type": FP8}


def run_kwargs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float,
               v_scale: float) -> dict[str, Any]:
    # Python floats: decode's run takes Optional[float], and skips its `out *= v_scale` only for the float 1.0.
    return {**fa.run_kwargs(q, k_cache, v_cache), "k_scale": float(k_scale), "v_scale": float(v_scale)}


class Fp8FlashInferBackend(FlashInferBackend):
    """L3's FlashInfer backend, planned for e4m3 pages and given each layer's scales at run.

    Named "flashinfer-fp8", not "flashinfer": L7's graph runner captures CUDA graphs only for "flashinfer", with
    a decode wrapper planned for pages in the model's dtype; fp8 decode steps run eagerly instead."""

    name = "flashinfer-fp8"

    def __init__(self, cfg: Qwen3Config, dtype: torch.dtype, device: torch.device, pool: Fp8KvPool):
        super().__init__(cfg, dtype, device)
        self.pool = pool

    def plan(self, meta: BatchMeta) -> None:
        if meta.decode_only:
            self.decode.plan(**decode_plan_kwargs(meta, self.cfg, self.dtype))
            self._wrapper = self.decode
        else:
            self.prefill.plan(**prefill_plan_kwargs(meta, self.cfg, self.dtype))
            self._wrapper = self.prefill
        self._planned = meta

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        if meta is not self._planned:
            raise RuntimeError("run() called with metadata that was not planned: call plan(meta) first")
        k_scale, v_scale = self.pool.scales(k_cache)
        return self._wrapper.run(**run_kwargs(q, k_cache, v_cache, k_scale, v_scale))


def fp8_backend(name: str, cfg: Qwen3Config, dtype: torch.dtype, device: torch.device,
                pool: Fp8KvPool) -> AttentionBackend:
    """auto: FlashInfer on CUDA where it can run, the torch oracle elsewhere (on the CPU, always). torch: the
    oracle. flashinfer: FlashInfer or a one-line error. cpp and batched do not read e4m3 pages."""
    global _said_why_not_flashinfer
    if name == "torch":
        return Fp8TorchBackend(pool)
    if name not in ("auto", "flashinfer"):
        raise CourseError(f"--kv-dtype fp8 pages are read by FlashInfer on CUDA (--backend flashinfer) or the torch "
                          f"oracle (--backend torch), not --backend {name} (the C++ kernel reads int8 pages)")
    if name == "auto" and device.type == "cpu":
        return Fp8TorchBackend(pool)
    reason = fa.unsupported_reason(cfg, dtype, device)
    if reason is None:
        return Fp8FlashInferBackend(cfg, dtype, device, pool)
    if name == "flashinfer":
        raise CourseError(f"--backend flashinfer cannot read fp8 pages: {reason}")
    if not _said_why_not_flashinfer:
        print(f"note: {reason}; fp8 pages are read by the torch oracle (slow)", file=sys.stderr)
        _said_why_not_flashinfer = True
    return Fp8TorchBackend(pool)

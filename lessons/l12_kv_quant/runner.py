"""A runner whose pool stores K and V quantized: any earlier runner (L8's, L10's) with L3's two seams,
`make_pool` and `make_backend`, answered differently. Nothing else about a step changes: the model writes
K/V through the pool (which quantizes) and attention reads the pool (the backend dequantizes as it reads)."""
from __future__ import annotations

from functools import cache

import torch

from lessons.l3_block_tensor.backends import AttentionBackend
from lessons.l3_block_tensor.kv_pool import BlockKvPool
from lessons.l10_tensor_parallel.runner import runner_factory
from lessons.l12_kv_quant.backends import int8_backend
from lessons.l12_kv_quant.fp8 import Fp8KvPool, fp8_backend
from lessons.l12_kv_quant.kv_pool import Int8KvPool
from shared.config import Qwen3Config
from shared.errors import CourseError

KV_DTYPES = ("auto", "int8", "fp8")  # auto: the model's dtype, every earlier lesson's pool; fp8: e4m3 (CUDA)


def check_kv_dtype(kv_dtype: object) -> str:
    if kv_dtype not in KV_DTYPES:
        raise CourseError(f"unknown kv-dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
    return kv_dtype


class QuantKvRunner:
    """Mixed in before a runner class (quantized() builds the pair)."""

    kv_dtype = "int8"
    base: type  # the runner class this one quantizes (quantized() sets it)

    @classmethod
    def recipe(cls) -> list[str]:
        """Over L10's runner: what its followers build, as names (L10's runner.py): `requantized` with this
        kv dtype and the base class's own names."""
        return [f"{__name__}:requantized", cls.kv_dtype, *cls.base.recipe()]

    def make_pool(self, cfg: Qwen3Config, num_blocks: int, block_size: int, dtype: torch.dtype) -> BlockKvPool:
        if self.kv_dtype == "fp8":
            return Fp8KvPool(cfg, num_blocks, block_size, self.device)
        return Int8KvPool(cfg, num_blocks, block_size, self.device)

    def make_backend(self, name: str, dtype: torch.dtype) -> AttentionBackend:
        if self.kv_dtype == "fp8":  # the pool exists by now (L3 makes it first): the backend reads its scales
            return fp8_backend(name, self.model.config, dtype, self.device, self.pool)
        return int8_backend(name, self.device)


@cache
def quantized(runner_class: type, kv_dtype: str) -> type:
    """runner_class over a pool of `kv_dtype` pages: a subclass with QuantKvRunner's seams, made once per pair
    (so rank 0 and every follower build the same class from the same two names)."""
    if check_kv_dtype(kv_dtype) == "auto":
        return runner_class
    return type(f"{kv_dtype.capitalize()}{runner_class.__name__}", (QuantKvRunner, runner_class),
                {"kv_dtype": kv_dtype, "base": runner_class})


@runner_factory
def requantized(kv_dtype: str, *base: str) -> type:
    """An L10 follower's quantized(base, kv_dtype), from rank 0's names: the same class rank 0 built."""
    from lessons.l10_tensor_parallel.follower import runner_class  # the follower's own loop resolves `base`

    return quantized(runner_class(*base), kv_dtype)

"""L12's engine: L11's (speculation, chunked prefill, abort), over a pool whose pages may be quantized.

`kv_dtype="auto"` keeps the model's dtype: every step is L11's, bit for bit. `"int8"` stores K and V as
int8 rows with a per-row scale (the C++ kernel reads them on the CPU); `"fp8"` as e4m3 with one scale per
layer (FlashInfer reads them on CUDA; fp8.py). A quantized pool is sized in bytes: the default budget is what
L11's default pool takes in the model's dtype, and int8 fits about twice the bf16 blocks (four times the fp32
ones) into it.
"""
from __future__ import annotations

import torch

from lessons.l2_token_flat.engine import DEFAULT_POOL_TOKENS, blocks_for, pool_blocks
from lessons.l11_speculative.engine import L11Engine, L11TpEngine
from lessons.l12_kv_quant.kv_pool import block_bytes
from lessons.l12_kv_quant.runner import check_kv_dtype, quantized
from shared.config import Qwen3Config
from shared.errors import CourseError
from shared.model import Qwen3ForCausalLM

STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # kv_dtype -> what the pool holds ("auto": the model's dtype)


def storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return STORAGE.get(kv_dtype, model_dtype)


# Task L12.5: size the pool in bytes: one block's K and V over every layer (int8 rows D + 4 wide), whole blocks in kv_bytes
def default_kv_bytes(cfg: Qwen3Config, block_size: int, model_dtype: torch.dtype) -> int:
    """The memory of L11's default pool: DEFAULT_POOL_TOKENS' worth of blocks in the model's dtype."""
    return blocks_for(DEFAULT_POOL_TOKENS, block_size) * block_bytes(cfg, block_size, model_dtype)


# Task L12.5: size the pool in bytes: one block's K and V over every layer (int8 rows D + 4 wide), whole blocks in kv_bytes
def blocks_in(kv_bytes: int, cfg: Qwen3Config, block_size: int, kv_dtype: torch.dtype) -> int:
    """Whole blocks of this storage dtype in kv_bytes (scales included for int8)."""
    return kv_bytes // block_bytes(cfg, block_size, kv_dtype)


class L12Engine(L11Engine):
    def __init__(self, model: Qwen3ForCausalLM, block_size: int = 16, num_blocks: int | None = None, *args,
                 kv_dtype: str = "auto", kv_bytes: int | None = None, **kwargs):
        self.kv_dtype = check_kv_dtype(kv_dtype)
        model_dtype = model.lm_head.weight.dtype
        pool_blocks(block_size, num_blocks)  # the block size and an explicit count are checked first
        if kv_bytes is not None and (isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes < 1):
            raise CourseError(f"kv-bytes must be a positive whole number of bytes, got {kv_bytes!r}")
        if num_blocks is None:  # the pool is sized in bytes; num_blocks, when given, overrides
            self.kv_bytes = kv_bytes or default_kv_bytes(model.config, block_size, model_dtype)
            num_blocks = blocks_in(self.kv_bytes, model.config, block_size, storage_dtype(kv_dtype, model_dtype))
            if num_blocks < 1:
                raise CourseError(f"kv-bytes {self.kv_bytes} holds no block of {block_size} tokens")
        self.runner_class = quantized(type(self).runner_class, kv_dtype)  # "auto": L11's runner itself
        super().__init__(model, block_size, num_blocks, *args, **kwargs)


class L12TpEngine(L12Engine, L11TpEngine):
    """The same over L10's split model: every rank's pool holds its own KV heads' rows, scales included."""

"""L12: a quantized KV cache. int8 rows with one scale per token and KV head, read in place by the kernel."""
from lessons.l12_kv_quant.engine import L12Engine, L12TpEngine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'kv pool': 'kv_pool.py::Int8KvPool.write',
    'quantizer': 'quantize.py::quantize',
}

__all__ = ["L12Engine", "L12TpEngine"]

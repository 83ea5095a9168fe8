"""L1: one request, one contiguous K/V buffer per layer, prefill then greedy decode."""
from lessons.l1_contiguous.engine import L1Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'kv seam': 'kv_cache.py::ContiguousKvCache.attend',
    'engine loop': 'engine.py::L1Engine.generate',
}

__all__ = ["L1Engine"]

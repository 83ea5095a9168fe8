"""L2: a token-flat paged KV pool. Blocks from a free list; a request's history gathered by slot index."""
from lessons.l2_token_flat.engine import L2Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'kv seam': 'kv_pool.py::KvPool.attend',
    'step metadata': 'forward_meta.py::ForwardMeta.for_step',
    'engine loop': 'engine.py::L2Engine.generate',
}

__all__ = ["L2Engine"]

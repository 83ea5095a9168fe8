"""L2: a token-flat paged KV pool. Blocks from a free list; a request's history gathered by slot index."""
from lessons.l2_token_flat.engine import L2Engine

__all__ = ["L2Engine"]

"""L3: block-tensor pages, CSR page tables, paged attention backends, many requests in one ragged forward."""
from lessons.l3_block_tensor.engine import L3Engine

__all__ = ["L3Engine"]

"""L1: one request, one contiguous K/V buffer per layer, prefill then greedy decode."""
from lessons.l1_contiguous.engine import L1Engine

__all__ = ["L1Engine"]

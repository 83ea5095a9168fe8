"""Which decode batch sizes get a graph, and which captured size a step of n requests is padded up to."""
from __future__ import annotations

from shared.errors import CourseError

SMALL_SIZES = (1, 2, 4, 8)  # small batches are the common case late in a run: cheap to capture each one
STRIDE = 8  # above 8, one graph every 8 rows: at most 7 padded rows per step


# Task L7.1: the sizes that get a graph (1, 2, 4, 8, then every 8), checked; the size n rows pad up to
def default_capture_sizes(max_running: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_running (no size above it: such a batch can never happen)."""
    sizes = [s for s in SMALL_SIZES if s <= max_running]
    sizes += range(SMALL_SIZES[-1] + STRIDE, max_running + 1, STRIDE)
    return sizes


# Task L7.1: the sizes that get a graph (1, 2, 4, 8, then every 8), checked; the size n rows pad up to
def check_capture_sizes(sizes: list[int], max_running: int) -> list[int]:
    """Sorted, distinct, each 1 .. max_running. An empty list means: no graphs, every step eager."""
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= max_running:
            raise CourseError(f"capture size {s!r} must be an integer from 1 to max-running ({max_running})")
    return sorted(set(sizes))


# Task L7.1: the sizes that get a graph (1, 2, 4, 8, then every 8), checked; the size n rows pad up to
def padded_size(sizes: list[int], n: int) -> int | None:
    """The smallest captured size that holds n rows, or None (n is above the largest: run eagerly)."""
    return next((s for s in sizes if s >= n), None)

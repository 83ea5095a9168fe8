"""L14's C++ ops: the matmul and RMSNorm of shared/cpu_ops.cpp, whose result for a row is computed the same way
whatever the batch. Every lesson's model already uses them for a decode step's few rows (shared/cpu_ops.py); L14's
mode uses them for every row count, a prefill's included. Built on first use as L3's kernel is (one build per cache
folder, under a lock, tuned to this CPU) and loaded from there afterwards."""
from __future__ import annotations

from shared.cpu_ops import load_ops

__all__ = ["load_ops"]

"""L14's C++ ops (invariant_ops.cpp): a matmul and an RMSNorm whose every output row is computed the same way
whatever the batch. Built on first use as L3's kernel is (its builder: one build per cache folder, under a lock,
tuned to this CPU) and loaded from there afterwards."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from lessons.l3_block_tensor.backends.cpp_backend import KernelUnavailable, _build_and_load

SOURCE = Path(__file__).with_name("invariant_ops.cpp")

_loaded: ModuleType | None = None
_failure: str | None = None


def load_ops() -> ModuleType:
    """The compiled module: `linear(x, w)` and `rms_norm(x, weight, eps)`. Raises KernelUnavailable (one line)."""
    global _loaded, _failure
    if _loaded is None and _failure is None:
        try:
            _loaded = _build_and_load(SOURCE)
        except KernelUnavailable as e:
            _failure = str(e)
    if _loaded is None:
        raise KernelUnavailable(_failure)
    return _loaded

"""L14's engine: L13's, with a batch-invariant mode. With `batch_invariant=True` a request's logits at every
position are bitwise the same whatever else the engine runs: alone or among others at any place in the batch,
its prompt in one piece or in L8's slices, after a prefix-cache hit or a miss, recomputed after preemption,
checked as a verify row (L11) or decoded plainly, as one of n siblings, over int8 pages (L12). Seeded sampling
then repeats too. Without it, every step is L13's, bit for bit.

What the mode changes is the model (model.py: the invariant matmul and RMSNorm) and the attention backend
(L3's C++ kernel, whose rows are invariant; the torch paths pick their kernels by shape). It holds for one
device, dtype and tensor-parallel degree: a different dtype rounds differently, and splitting a matmul over
ranks adds partial sums in another order.
"""
from __future__ import annotations

import torch

from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING
from lessons.l13_structured.engine import L13Engine
from lessons.l14_batch_invariant.model import INVARIANT_DTYPES, invariant_model
from shared.errors import CourseError
from shared.model import Qwen3ForCausalLM

INVARIANT_BACKENDS = ("auto", "cpp")  # auto means cpp here


# Task L14.4: the engine's mode: the invariant model and L3's C++ kernel, or one line saying why not
def check_invariant_setup(model: Qwen3ForCausalLM, backend: str) -> None:
    """One line for each setup the mode cannot make invariant (before anything is built)."""
    weight = model.lm_head.weight
    if weight.device.type != "cpu":
        raise CourseError(f"--batch-invariant runs on the CPU here, not {weight.device.type}: on a GPU it needs "
                          f"FlashInfer with a fixed split size and a matmul without split-K "
                          f"(docs/l14_batch_invariant_appendix.md, 'On a GPU')")
    if weight.dtype not in INVARIANT_DTYPES:
        dtype = str(weight.dtype).removeprefix("torch.")
        raise CourseError(f"--batch-invariant computes in float32 or bfloat16, not {dtype}")
    if backend not in INVARIANT_BACKENDS:
        raise CourseError(f"--batch-invariant attends with the C++ kernel (--backend cpp or auto), not --backend "
                          f"{backend}: the torch backends pick their matmul kernels by the step's shape")


class L14Engine(L13Engine):
    # Task L14.4: the engine's mode: the invariant model and L3's C++ kernel, or one line saying why not
    def __init__(self, model: Qwen3ForCausalLM, block_size: int = 16, num_blocks: int | None = None,
                 max_running: int = DEFAULT_MAX_RUNNING, backend: str = "auto", *, batch_invariant: bool = False,
                 **kwargs):
        if batch_invariant is not True and batch_invariant is not False:
            raise CourseError(f"batch_invariant must be True or False, got {batch_invariant!r}")
        self.batch_invariant = batch_invariant
        if batch_invariant:
            check_invariant_setup(model, backend)
            model, backend = invariant_model(model), "cpp"
        super().__init__(model, block_size, num_blocks, max_running, backend, **kwargs)

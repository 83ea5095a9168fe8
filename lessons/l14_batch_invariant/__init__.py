"""L14: batch invariance. A request's logits are bitwise the same whatever else is in the batch: every matmul and
RMSNorm sums in one fixed order per row (shared/cpu_ops.cpp), and attention is L3's kernel, whose rows already are."""
from lessons.l14_batch_invariant.engine import L14Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'invariant model': 'model.py::invariant_model',
    'engine setup': 'engine.py::L14Engine.__init__',
}

__all__ = ["L14Engine"]

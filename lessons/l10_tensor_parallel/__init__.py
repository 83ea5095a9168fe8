"""L10: tensor parallelism. Heads, MLP width and vocabulary split across ranks; two all-reduces per layer."""
from lessons.l10_tensor_parallel.engine import L10Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'model split': 'model.py::TpQwen3ForCausalLM.__init__',
    'all-reduce': 'layers.py::RowParallelLinear.forward',
    'step broadcast': 'runner.py::TpRunner.forward',
    'follower loop': 'follower.py::follow',
}

__all__ = ["L10Engine"]

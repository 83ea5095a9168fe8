"""L8: chunked prefill. One token budget per step; decodes first, then prompt slices, in one ragged forward."""
from lessons.l8_chunked_prefill.engine import L8Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'engine loop': 'engine.py::L8Engine.step',
    'scheduling': 'scheduler.py::ChunkedScheduler.schedule',
    'admission': 'scheduler.py::ChunkedScheduler.admit',
    'decode step': 'runner.py::ChunkedRunner.forward',
}

__all__ = ["L8Engine"]

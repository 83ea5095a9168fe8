"""L4: continuous batching. A scheduler admits and retires requests every step; per-request sampling."""
from lessons.l4_continuous.engine import Arrival, L4Engine
from lessons.l4_continuous.sampling import SamplingParams

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'engine loop': 'engine.py::L4Engine.step',
    'scheduling': 'scheduler.py::Scheduler.schedule',
    'admission': 'scheduler.py::Scheduler.admit',
    'sampling': 'sampling.py::sample_row',
}

__all__ = ["Arrival", "L4Engine", "SamplingParams"]

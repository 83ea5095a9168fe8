"""L5: preemption. Admit on current need; when decode finds the pool empty, recompute or swap."""
from lessons.l5_preemption.engine import L5Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'scheduling': 'scheduler.py::PreemptingScheduler.schedule',
    'admission': 'scheduler.py::PreemptingScheduler.admit',
    'preemption': 'scheduler.py::PreemptingScheduler.preempt',
}

__all__ = ["L5Engine"]

"""L11: speculative decoding. Drafts checked in one forward, pages rolled back to what the target kept."""
from lessons.l11_speculative.engine import L11Engine, L11TpEngine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'engine loop': 'engine.py::L11Engine.step',
    'scheduling': 'scheduler.py::SpecScheduler.draft_room',
    'rollback': 'scheduler.py::SpecScheduler.roll_back',
    'verify rule': 'verify.py::accept_one_hot',
}

__all__ = ["L11Engine", "L11TpEngine"]

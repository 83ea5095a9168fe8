"""L13: structured output. A grammar's token mask on the logits before sampling; matchers rolled back with drafts."""
from lessons.l13_structured.engine import L13Engine, L13TpEngine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'sampling': 'engine.py::L13Engine.choose',
    'token mask': 'engine.py::L13Engine.mask_rows',
}

__all__ = ["L13Engine", "L13TpEngine"]

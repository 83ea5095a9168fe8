"""L5: preemption. Admit on current need; when decode finds the pool empty, recompute or swap."""
from lessons.l5_preemption.engine import L5Engine

__all__ = ["L5Engine"]

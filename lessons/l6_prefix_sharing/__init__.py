"""L6: prefix sharing. Ref-counted blocks, a hash-chained prefix cache with LRU eviction, copy-on-write forks."""
from lessons.l6_prefix_sharing.engine import L6Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'engine loop': 'engine.py::L6Engine.step',
    'admission': 'scheduler.py::PrefixScheduler.admit',
    'preemption': 'scheduler.py::PrefixScheduler.preempt',
    'allocator': 'block_manager.py::RefBlockManager.alloc',
}

__all__ = ["L6Engine"]

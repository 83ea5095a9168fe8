"""L15: prefill/decode disaggregation. Two engines, each L14's: P prefills and leases the prompt's blocks, D pulls the
blocks its prefix cache lacks over a loopback socket (no pickle), files them in that cache and decodes."""
from lessons.l15_disaggregated.engine import L15Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'engine setup': 'engine.py::L15Engine.__init__',
    'step': 'engine.py::L15Engine.step',
}

__all__ = ["L15Engine"]

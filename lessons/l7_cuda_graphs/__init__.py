"""L7: CUDA graphs. Static decode buffers, captured batch sizes, padding into a reserved dummy block."""
from lessons.l7_cuda_graphs.engine import L7Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'kv seam': 'graph_runner.py::GraphRunner.attend',
    'decode step': 'graph_runner.py::GraphRunner.forward',
    'static buffers': 'static_buffers.py::StaticDecodeBuffers.fill',
    'capture': 'graph_runner.py::GraphRunner.capture',
}

__all__ = ["L7Engine"]

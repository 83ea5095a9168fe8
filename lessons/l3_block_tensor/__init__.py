"""L3: block-tensor pages, CSR page tables, paged attention backends, many requests in one ragged forward."""
from lessons.l3_block_tensor.engine import L3Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'kv seam': 'runner.py::PagedRunner.attend',
    'step metadata': 'batch_meta.py::BatchMeta.build',
    'attention': 'backends/torch_backend.py::TorchBackend.run',
    'engine loop': 'engine.py::L3Engine.generate_batch',
}

__all__ = ["L3Engine"]

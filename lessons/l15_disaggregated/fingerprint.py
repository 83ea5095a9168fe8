"""An engine's fingerprint: everything that decides the bytes of a K/V page, hashed. D files pulled pages in its
prefix cache, which is keyed by tokens alone, so it must refuse pages another model, dtype, pool or mode wrote:
its cache would hand them to every later request with that prefix."""
from __future__ import annotations

import hashlib

import torch

from lessons.l14_batch_invariant import L14Engine


# Task L15.2: typed headers and the layout: refused before anything is read or allocated, another engine's pages too
def fingerprint(engine: L14Engine) -> int:
    """63 bits of blake2b over the model's config, a sample of every weight (its name, shape, dtype and first 64
    values), the pool's dtype and block size, and L14's mode (it changes how K and V are summed)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(engine.model.config).encode())
    for name, p in engine.model.state_dict().items():
        h.update(f"{name} {tuple(p.shape)} {p.dtype}".encode())
        h.update(p.detach().reshape(-1)[:64].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    pool = engine.runner.pool
    h.update(f"{pool.k[0].dtype} {engine.block_size} {getattr(engine, 'batch_invariant', False)}".encode())
    return int.from_bytes(h.digest(), "little") >> 1

"""A model-free stand-in for L3's PagedRunner, for fast scheduler tests.

Its "KV" is the token id itself, written to the request's slots in a pool shaped like L3's
([num_blocks, block_size, 1, 1] per layer), and its logits are a hash of the history it reads back
from those slots. So a block that is lost, shared, or restored wrongly changes the next token, just
as with the real model, at a tiny fraction of the cost.
"""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from lessons.l2_token_flat.block_allocator import BlockAllocator
from shared.config import Qwen3Config

VOCAB = 64


class FakePool:
    def __init__(self, num_blocks: int, block_size: int, layers: int = 2):
        shape = (num_blocks, block_size, 1, 1)
        self.k = [torch.full(shape, -1.0) for _ in range(layers)]
        self.v = [torch.full(shape, -1.0) for _ in range(layers)]


class FakeRunner:
    def __init__(self, block_size: int, num_blocks: int):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.pool = FakePool(num_blocks, block_size)
        self.forwards = 0

    def forward(self, requests) -> torch.Tensor:
        self.forwards += 1
        out = []
        for r in requests:
            tokens = r.prompt_ids + r.output_ids
            assert r.num_cached < r.num_tokens, "a request fed with nothing new"
            for p in range(r.num_cached, r.num_tokens):
                b, o = r.blocks[p // self.block_size], p % self.block_size  # IndexError: block not reserved
                for t in self.pool.k + self.pool.v:
                    t[b, o, 0, 0] = float(tokens[p])
            history = [int(self.pool.k[-1][r.blocks[p // self.block_size], p % self.block_size, 0, 0])
                       for p in range(r.num_tokens)]
            r.num_cached = r.num_tokens
            out.append(logits_for(history))
        return torch.stack(out)


def logits_for(history: list[int]) -> torch.Tensor:
    digest = hashlib.sha256(repr(history).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(VOCAB, generator=g) * 3


def reference(prompt: list[int], max_new: int) -> list[int]:
    """What a correct engine must emit greedily: argmax of the hash of the true history."""
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(int(logits_for(tokens).argmax()))
    return tokens[len(prompt):]


def fake_model(max_positions: int = 4096) -> SimpleNamespace:
    cfg = Qwen3Config(VOCAB, 8, 8, 2, 1, 1, 8, 1e-6, 1e6, max_positions, True, ())
    return SimpleNamespace(config=cfg, lm_head=SimpleNamespace(weight=torch.zeros(1)))

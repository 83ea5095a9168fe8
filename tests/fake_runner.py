"""A model-free stand-in for L3's PagedRunner, for fast scheduler tests.

Its "KV" is the token id itself, encoded differently in every layer's K and V, written to the request's
slots in a pool shaped like L3's ([num_blocks, block_size, 1, 1] per layer). Its logits are a hash of
the history it reads back from those slots. So a block that is lost, shared, or restored wrongly changes
the next token, just as with the real model, at a tiny fraction of the cost; and a slot whose layers or
K and V disagree (a swap or copy that moved only K, or only layer 0) fails at once with an assertion.
"""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from lessons.l2_token_flat.block_allocator import BlockAllocator
from shared.config import Qwen3Config

VOCAB = 64
LAYERS = 2


def encode_k(token: int, layer: int) -> float:
    # A different affine map per layer: a block copied from the wrong layer decodes to a different token.
    return float(token * (2 * layer + 1) + 1)


def encode_v(token: int, layer: int) -> float:
    # Negative, unlike every K: V copied into K's place (or the reverse) cannot decode to a valid token.
    return float(-token * (layer + 2) - 3)


def decode_k(value: float, layer: int) -> float:
    return (value - 1) / (2 * layer + 1)


def decode_v(value: float, layer: int) -> float:
    return (-value - 3) / (layer + 2)


class FakePool:
    def __init__(self, num_blocks: int, block_size: int, layers: int = LAYERS):
        shape = (num_blocks, block_size, 1, 1)
        # -1 decodes to a different value in every layer's K and V, so reading a slot never written fails.
        self.k = [torch.full(shape, -1.0) for _ in range(layers)]
        self.v = [torch.full(shape, -1.0) for _ in range(layers)]


class FakeRunner:
    def __init__(self, block_size: int, num_blocks: int):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.pool = FakePool(num_blocks, block_size)
        self.forwards = 0
        self.tokens_fed = 0  # every position any forward wrote K/V for: what the engine really computed
        # The last forward, one row per request: (seq_id, first position fed, tokens after it, block table).
        # A row's first position is its num_cached on entry: for a fresh admission, the tokens it was served
        # from the prefix cache; it feeds positions first .. tokens - 1.
        self.last_rows: list[tuple[int, int, int, tuple[int, ...]]] = []

    def forward(self, requests) -> torch.Tensor:
        self.forwards += 1
        self.last_rows = []
        out = []
        for r in requests:
            tokens = r.prompt_ids + r.output_ids
            assert r.num_cached < r.num_tokens, "a request fed with nothing new"
            self.last_rows.append((getattr(r, "seq_id", -1), r.num_cached, r.num_tokens, tuple(r.blocks)))
            self.tokens_fed += r.num_tokens - r.num_cached
            for p in range(r.num_cached, r.num_tokens):
                b, o = self._slot(r, p)
                for layer, (k, v) in enumerate(zip(self.pool.k, self.pool.v)):
                    k[b, o, 0, 0] = encode_k(tokens[p], layer)
                    v[b, o, 0, 0] = encode_v(tokens[p], layer)
            history = [self._read(r, p) for p in range(r.num_tokens)]
            r.num_cached = r.num_tokens
            out.append(logits_for(history))
        return torch.stack(out)

    def _slot(self, r, p: int) -> tuple[int, int]:
        return r.blocks[p // self.block_size], p % self.block_size  # IndexError: block not reserved

    def _read(self, r, p: int) -> int:
        """The token position p holds according to the pool: every layer's K and V must name the same one."""
        b, o = self._slot(r, p)
        seen = []
        for layer, (k, v) in enumerate(zip(self.pool.k, self.pool.v)):
            seen.append((f"K{layer}", decode_k(float(k[b, o, 0, 0]), layer)))
            seen.append((f"V{layer}", decode_v(float(v[b, o, 0, 0]), layer)))
        token = seen[0][1]
        assert all(t == token for _, t in seen), (
            f"request {getattr(r, 'seq_id', '?')} position {p} (block {b}, offset {o}): the pool's layers "
            f"disagree on its token: {', '.join(f'{name}={t:g}' for name, t in seen)}"
        )
        # A stale slot written whole for another position names a real token: it is hashed as read, so the
        # next token changes, as a lost block changes the real model's.
        return int(token)


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


class FakeChunkRunner(FakeRunner):
    """FakeRunner behind L8's runner contract, for L8Engine's `runner_class` (L7's engine builds its runner
    itself, as runner_class(model, block_size, num_blocks, backend), then calls capture(sizes, dummy_block)).

    forward(slices) computes every slice, as FakeRunner does, and returns logits rows only for the slices
    that sample (`slice.samples`), in batch order: a slice that stops inside a prompt gets none. Graphs are
    never captured (a test passes graphs=False); capture only records the dummy block.
    """

    def __init__(self, model, block_size: int, num_blocks: int, backend: str = "auto"):
        super().__init__(block_size, num_blocks)
        self.model, self.backend_choice = model, backend
        self.dummy_block, self.sizes = -1, []
        self.eager_steps = 0
        self.replays = 0  # never: the fake has no graphs

    def capture(self, sizes: list[int], dummy_block: int) -> None:
        self.sizes, self.dummy_block = sorted(sizes), dummy_block

    def forward(self, slices) -> torch.Tensor:
        self.eager_steps += 1
        sampling = [i for i, s in enumerate(slices) if s.samples]  # before: forward advances num_cached
        logits = super().forward(slices)
        return logits[sampling]

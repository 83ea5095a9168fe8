"""The machine's own ceiling for a benchmark run: how long the work a system did would take at the matmul rate
this machine reaches, measured in the same run, at the same shapes, dtype and thread count.

A system's work is a `WorkLog`: how many tokens each forward fed through the layers, which (query rows, keys)
each sequence's attention covered, and how many rows each vocabulary projection computed. Its FLOPs:

    layers     2 x P_lin x layers per token fed   (P_lin = q, k, v, o, gate, up, down weights of one layer)
    attention  2 x 2 x H_q x D x layers per (query, key) pair a causal kernel computes
    vocab      2 x E x V per row the vocab projection computes (one per sampled token)

roofline seconds = sum over op shapes of FLOPs / the rate measured at that shape. Each op's token count is
rounded to the nearest power of 4 (in log scale) and timed once there, so a run times a handful of shapes.

A matmul's weight is read from memory, not from a cache, as in a model's step: a step reads each weight once,
and the rest of the model passes through the cache before the next step reads it again. So each timed call
takes its weight from the next slice of a buffer as large as the model's weights (at most WEIGHT_POOL_CAP);
one weight timed again and again would sit in the cache, and at decode's few rows, where a matmul's time is
reading its weight, run up to several times faster than any step can (`profile_l4.py --matmul-floor`).
"""
from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from shared.config import Qwen3Config

WEIGHT_POOL_CAP = 512 * 2**20  # bytes: well past a CPU's last-level cache or a GPU's L2, whatever the model


@dataclass
class WorkLog:
    """What one system computed, counted by shape so a long run stays a few dozen entries."""
    layer_tokens: Counter[int] = field(default_factory=Counter)  # tokens in one forward -> forwards
    attention: Counter[tuple[int, int]] = field(default_factory=Counter)  # (query rows, keys) of a sequence -> count
    vocab_rows: Counter[int] = field(default_factory=Counter)  # rows of one vocab projection -> calls

    def add_forward(self, tokens: int, seqs: list[tuple[int, int]]) -> None:
        self.layer_tokens[tokens] += 1
        self.attention.update(seqs)

    @property
    def tokens_fed(self) -> int:
        return sum(t * n for t, n in self.layer_tokens.items())

    @property
    def rows_sampled(self) -> int:
        return sum(r * n for r, n in self.vocab_rows.items())


def linear_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, int]]:
    """One decoder layer's matmuls as (in features, out features), in the order the layer runs them."""
    e, q, kv, i = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"q": (e, q), "k": (e, kv), "v": (e, kv), "o": (q, e), "gate": (e, i), "up": (e, i), "down": (i, e)}


def linear_params(cfg: Qwen3Config) -> int:
    """Weights one token meets in one layer's matmuls (norms and RoPE are not matmuls, so not here)."""
    return sum(k * n for k, n in linear_shapes(cfg).values())


def matmul_weights(cfg: Qwen3Config) -> int:
    """Weights a step's matmuls read: every layer's and the vocabulary projection's."""
    return cfg.num_hidden_layers * linear_params(cfg) + cfg.hidden_size * cfg.vocab_size


def causal_pairs(queries: int, keys: int) -> int:
    """(query, key) pairs a causal kernel computes when `queries` new tokens end a history of `keys` tokens:
    query t (0-based) sees keys - queries + t + 1 keys."""
    return queries * keys - queries * (queries - 1) // 2


def flops(cfg: Qwen3Config, log: WorkLog) -> dict[str, int]:
    layers = cfg.num_hidden_layers
    pairs = sum(causal_pairs(q, k) * n for (q, k), n in log.attention.items())
    return {
        "layers": 2 * linear_params(cfg) * layers * log.tokens_fed,
        # Q K^T and then P V: two products of H_q x D multiply-adds per pair.
        "attention": 2 * 2 * cfg.num_attention_heads * cfg.head_dim * layers * pairs,
        "vocab": 2 * cfg.hidden_size * cfg.vocab_size * log.rows_sampled,
    }


def bucket(n: int) -> int:
    """The power of 4 nearest to n in log scale: shapes within 2x of each other share one timing."""
    return 4 ** round(math.log(max(n, 1), 4))


def best_seconds(fn: Callable[[], object], budget_s: float = 0.05) -> float:
    """Fastest of repeated calls (the ceiling, not the average): one warm-up, then at least 3 timed calls and
    `budget_s` of them, so one call slowed by a neighbour's burst does not set the rate."""
    fn()
    times: list[float] = []
    while len(times) < 3 or sum(times) < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


class Rates:
    """Measured FLOP/s, one timing per shape, kept for every system of one model."""

    def __init__(self, cfg: Qwen3Config, dtype: torch.dtype, device: torch.device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.cache: dict[tuple, float] = {}
        # Weights are cut from this buffer in turn, so each timed call reads its weight from memory (see the top).
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.pool = torch.randn(min(matmul_weights(cfg), WEIGHT_POOL_CAP // itemsize), dtype=dtype, device=device)
        self.cursor = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _weights(self, k: int, n: int) -> Iterator[torch.Tensor]:
        """[n, k] slices of the pool, in order from where the last timing stopped, round and round. Cut ahead
        of the timing, so a timed call pays for no slicing."""
        size = n * k
        if size > self.pool.numel():  # larger than the pool, so than any cache: one weight, read cold each time
            return itertools.repeat(torch.randn(n, k, dtype=self.dtype, device=self.device))
        count = self.pool.numel() // size
        first = -(-self.cursor // size) % count  # the first slice at or past where the last timing stopped
        views = [self.pool[i * size:(i + 1) * size].view(n, k) for i in range(count)]

        def each() -> Iterator[torch.Tensor]:
            for i in itertools.count(first):
                self.cursor = (i + 1) % count * size
                yield views[i % count]
        return each()

    def linear(self, m: int, k: int, n: int) -> float:
        """F.linear(x [m, k], w [n, k]), the call the model makes."""
        key = ("linear", m, k, n)
        if key not in self.cache:
            x = torch.randn(m, k, dtype=self.dtype, device=self.device)
            weights = self._weights(k, n)
            run = lambda: (torch.nn.functional.linear(x, next(weights)), self._sync())  # noqa: E731
            self.cache[key] = 2 * m * k * n / best_seconds(run)
        return self.cache[key]

    def attention(self, queries: int, keys: int) -> float:
        """Scores of one sequence as a batched matmul: per KV head, its G query heads' rows times the keys."""
        key = ("attention", queries, keys)
        if key not in self.cache:
            c = self.cfg
            group = c.num_attention_heads // c.num_key_value_heads
            q = torch.randn(c.num_key_value_heads, group * queries, c.head_dim, dtype=self.dtype, device=self.device)
            k = torch.randn(c.num_key_value_heads, c.head_dim, keys, dtype=self.dtype, device=self.device)
            run = lambda: (torch.matmul(q, k), self._sync())  # noqa: E731
            self.cache[key] = 2 * c.num_attention_heads * queries * c.head_dim * keys / best_seconds(run)
        return self.cache[key]


def roofline_by_op(cfg: Qwen3Config, log: WorkLog, rates: Rates) -> dict[str, float]:
    """The work in `log` at the measured rates, each op at its own (bucketed) shape, in seconds per op kind."""
    layers, out = cfg.num_hidden_layers, {"layers": 0.0, "attention": 0.0, "vocab": 0.0}
    per_layer = linear_shapes(cfg).values()
    for tokens, n in log.layer_tokens.items():
        m = bucket(tokens)
        out["layers"] += n * layers * sum(2 * tokens * k * o / rates.linear(m, k, o) for k, o in per_layer)
    e, v = cfg.hidden_size, cfg.vocab_size
    for rows, n in log.vocab_rows.items():
        out["vocab"] += n * 2 * rows * e * v / rates.linear(bucket(rows), e, v)
    per_pair = 2 * 2 * cfg.num_attention_heads * cfg.head_dim * layers
    for (q, k), n in log.attention.items():
        out["attention"] += n * per_pair * causal_pairs(q, k) / rates.attention(bucket(q), bucket(k))
    return out


def roofline_seconds(cfg: Qwen3Config, log: WorkLog, rates: Rates) -> float:
    return sum(roofline_by_op(cfg, log, rates).values())

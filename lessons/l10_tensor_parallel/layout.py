"""Which part of every weight each rank holds. Every part is one contiguous range along one dimension.

  q_proj, k_proj, v_proj    rows of this rank's heads      (column-parallel: each rank computes its heads)
  o_proj                    columns of this rank's q heads (row-parallel: partial sums, then an all-reduce)
  gate_proj, up_proj        rows of its share of the MLP's width
  down_proj                 columns of that share          (row-parallel)
  embed_tokens, lm_head     rows of its share of the vocabulary
  norms (q_norm, k_norm per head; the layer norms on the full hidden state): all of them, on every rank

When there are fewer KV heads than ranks, each KV head is held by several ranks: rank r keeps head
r * Hkv // tp, the one its query heads read (queries are grouped by KV head in order).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from shared.config import Qwen3Config
from shared.errors import CourseError

# The module names whose weights are split, and how: (dim, which range of the layout, in heads or not).
SPLIT = {
    "q_proj": (0, "q_heads"), "k_proj": (0, "kv_heads"), "v_proj": (0, "kv_heads"), "o_proj": (1, "q_heads"),
    "gate_proj": (0, "mlp"), "up_proj": (0, "mlp"), "down_proj": (1, "mlp"),
    "embed_tokens": (0, "vocab"), "lm_head": (0, "vocab"),
}


@dataclass(frozen=True)
class TpLayout:
    rank: int
    size: int
    head_dim: int
    q_heads: range  # query heads this rank computes
    kv_heads: range  # key/value heads it computes and keeps in its pool (one, shared with others, when replicated)
    mlp: range  # its rows of the MLP's intermediate dimension
    vocab: range  # its token ids, in the embedding and the LM head

    # Task L10.1: each rank's query heads, KV heads (one kept by several when tp > Hkv), MLP rows, token ids
    @classmethod
    def of(cls, cfg: Qwen3Config, rank: int, size: int) -> "TpLayout":
        check_tp(cfg, size)
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads

        def share(total: int) -> range:
            n = total // size
            return range(rank * n, (rank + 1) * n)

        kv = share(hkv) if hkv >= size else range(rank * hkv // size, rank * hkv // size + 1)
        return cls(rank, size, cfg.head_dim, share(hq), kv, share(cfg.intermediate_size), share(cfg.vocab_size))

    # Task L10.1: each rank's query heads, KV heads (one kept by several when tp > Hkv), MLP rows, token ids
    def local_config(self, cfg: Qwen3Config) -> Qwen3Config:
        """The config of this rank's part: its head counts and MLP width (hidden size and vocabulary as is).
        Everything that sizes the KV pool and the attention kernels reads these, so they need no change."""
        return replace(cfg, num_attention_heads=len(self.q_heads), num_key_value_heads=len(self.kv_heads),
                       intermediate_size=len(self.mlp))

    # Task L10.2: (dim, start, stop) of each checkpoint tensor this rank loads; None: every rank holds all of it
    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor `name` on this rank; None: every rank holds all of it."""
        module = name.split(".")[-2] if "." in name else name
        if module not in SPLIT:
            return None
        dim, which = SPLIT[module]
        part: range = getattr(self, which)
        scale = self.head_dim if which.endswith("heads") else 1  # heads are head_dim rows (or columns) each
        return dim, part.start * scale, part.stop * scale


# Task L10.1: each rank's query heads, KV heads (one kept by several when tp > Hkv), MLP rows, token ids
def check_tp(cfg: Qwen3Config, tp: int) -> None:
    """One line naming what --tp cannot split in this model."""
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if tp < 1:
        raise CourseError(f"--tp must be at least 1, got {tp}")
    if hq % tp:
        raise CourseError(f"--tp {tp} does not divide the model's {hq} attention heads")
    if hkv % tp and tp % hkv:
        raise CourseError(f"--tp {tp}: the model's {hkv} key/value heads can be neither split {tp} ways nor "
                          f"replicated ({tp} must divide {hkv} or be a multiple of it)")
    for value, name in ((cfg.intermediate_size, "intermediate_size"), (cfg.vocab_size, "vocab_size")):
        if value % tp:
            raise CourseError(f"--tp {tp} does not divide the model's {name} {value}")

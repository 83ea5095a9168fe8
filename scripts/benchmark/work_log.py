"""Count what a system really computed, by hooks on the models rather than by trusting each system's own
bookkeeping: every forward's tokens and its sequences' (query rows, keys), every vocab projection's rows.

The same hooks see HF generate (batch rows x new tokens after a cache of `past` tokens: padding included,
since a padded row goes through the matmuls too), HF's continuous batching (packed sequences described by
cu_seq_lens_q / cu_seq_lens_k) and the course's runner (a flat stream described by BatchMeta.qo_indptr).
Re-prefills after a preemption are forwards like any other, so they are counted.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from roofline import WorkLog


def _diffs(bounds: list[int]) -> list[int]:
    return [b - a for a, b in zip(bounds, bounds[1:])]


def ours_forward(log: WorkLog, args: tuple) -> None:
    """Qwen3ForCausalLM.forward(input_ids [T], positions [T], kv, meta) as the paged runner calls it."""
    tokens, positions, _, meta = args
    pos = positions.tolist()
    qo = meta.qo_indptr.tolist() if hasattr(meta, "qo_indptr") else [0, len(pos)]  # L1/L2: one request
    # A sequence's last new token sits at position keys - 1: its history, new tokens included.
    log.add_forward(tokens.numel(), [(n, pos[end - 1] + 1) for n, end in zip(_diffs(qo), qo[1:]) if n])


def hf_forward(log: WorkLog, kwargs: dict) -> None:
    """HF's decoder stack, called by generate (with a cache object) or by generate_batch (packed, varlen)."""
    ids = kwargs["input_ids"]
    if kwargs.get("cu_seq_lens_q") is not None:
        keys = kwargs["cu_seq_lens_k"]
        keys = next(iter(keys.values())) if isinstance(keys, dict) else keys  # one entry per layer type
        seqs = list(zip(_diffs(kwargs["cu_seq_lens_q"].tolist()), _diffs(keys.tolist())))
        log.add_forward(ids.numel(), [(q, k) for q, k in seqs if q])
        return
    cache = kwargs.get("past_key_values")
    past = cache.get_seq_length() if cache is not None else 0
    rows, new = ids.shape
    log.add_forward(ids.numel(), [(new, past + new)] * rows)


@contextmanager
def recording(ours: torch.nn.Module, hf: torch.nn.Module) -> Iterator[WorkLog]:
    """Hooks on both models for the duration of one system's run; only the one that runs fills the log."""
    log = WorkLog()

    def rows(module, args, output) -> None:
        log.vocab_rows[args[0].shape[:-1].numel()] += 1

    handles = [
        ours.register_forward_pre_hook(lambda m, args: ours_forward(log, args)),
        ours.lm_head.register_forward_hook(rows),
        hf.model.register_forward_pre_hook(lambda m, args, kwargs: hf_forward(log, kwargs), with_kwargs=True),
        hf.lm_head.register_forward_hook(rows),
    ]
    try:
        yield log
    finally:
        for h in handles:
            h.remove()

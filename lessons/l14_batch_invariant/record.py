"""How invariance is checked: every logits row a request samples from, kept by the output index it chooses, and
the first difference between two such records, down to the bit.

A request's row for output index i is the one its token i is chosen from: a plain decode's row, the last row of
its prompt's final slice, a verify row j of L11 (the rows up to the target's own token: later ones saw drafts
the target rejected, so they have no counterpart in a plain run), or a sibling's share of its parent's row (n > 1).
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l6_prefix_sharing.sequence import SharedSequence
from shared.generation import StopRule


class LogitsRecord:
    """Wraps `engine.choose` on this one engine: rows[seq_id][i] is the fp32 row output token i came from."""

    # Task L14.1: record each request's logits row by output index; name the first difference, to the bit
    def __init__(self, engine, keep: Callable[[SharedSequence], bool] = lambda seq: True):
        self.rows: dict[int, dict[int, torch.Tensor]] = {}
        choose = engine.choose

        def recording(logits: torch.Tensor, groups: list) -> list[list[int]]:
            # copied before choose: L13 masks rows in place, and the record holds what the model gave
            copies = [logits[rows.start:rows.stop].clone() if keep(seq) else None for seq, rows, _ in groups]
            emitted = choose(logits, groups)
            for (seq, _, _), copy, tokens in zip(groups, copies, emitted):
                if copy is None:
                    continue
                # a plain group has one row; a verify group's rows past the target's own token saw rejected drafts.
                # The tokens are committed after choose: output_ids does not hold them yet.
                for j, row in enumerate(copy[:len(tokens)]):
                    self.rows.setdefault(seq.seq_id, {})[len(seq.output_ids) + j] = row
            return emitted

        engine.choose = recording

    # Task L14.1: record each request's logits row by output index; name the first difference, to the bit
    def of(self, seq: SharedSequence) -> torch.Tensor:
        """[outputs, vocab]: the rows of output indices 0, 1, ... (every one must have been recorded)."""
        got = self.rows.get(seq.seq_id, {})
        missing = [i for i in range(len(seq.output_ids)) if i not in got]
        if missing:
            raise AssertionError(f"request {seq.seq_id}: no logits recorded for output index {missing[0]}")
        return torch.stack([got[i] for i in range(len(seq.output_ids))])


# Task L14.1: record each request's logits row by output index; name the first difference, to the bit
def first_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when a and b ([outputs, vocab] fp32) are bitwise equal; else the first differing logit in words:
    output index, token id, both values with their bits, and the highest bit that differs."""
    if a.shape != b.shape:
        return f"shapes differ: {list(a.shape)} against {list(b.shape)} (a different number of outputs)"
    differs = (a.view(torch.int32) != b.view(torch.int32)).nonzero()
    if len(differs) == 0:
        return None
    index, token = differs[0].tolist()
    x, y = a[index, token].item(), b[index, token].item()
    bits_x, bits_y = (struct.unpack("<I", struct.pack("<f", v))[0] for v in (x, y))
    bit = (bits_x ^ bits_y).bit_length() - 1  # 31: sign, 30-23: exponent, 22-0: mantissa
    where = "the sign" if bit == 31 else "the exponent" if bit >= 23 else f"mantissa bit {bit} (0 is the last of 23)"
    rows = int((a != b).any(-1).sum())
    return (f"output {index}, token {token}: {x!r} (0x{bits_x:08x}) against {y!r} (0x{bits_y:08x}), highest differing "
            f"bit: {where}; {rows} of {a.shape[0]} rows differ")


@dataclass
class Recorded:
    """One run: each kept request's output tokens and its logits rows [outputs, vocab], and the engine (its stats)."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    engine: object


def run_recorded(engine, prompts: Sequence[list[int]], stop: StopRule, *, keep: int | None = None,
                 first: list[int] | None = None, sampling: Callable[[int], SamplingParams] = lambda i: SamplingParams(),
                 n: Callable[[int], int] = lambda i: 1) -> Recorded:
    """All `prompts` submitted at once to `engine` (after the `first` prompt, if given, has run to its end: the
    prefix cache then holds its blocks); logits kept for the first `keep` prompts (default: all), each prompt's
    n(i) siblings in order."""
    if first:
        engine.generate_batch([first], stop)
    kept: set[int] = set()
    record = LogitsRecord(engine, keep=lambda seq: seq.seq_id in kept)
    seqs = []
    for i, ids in enumerate(prompts):
        group = engine.add_parallel(ids, stop, sampling(i), n(i))
        if keep is None or i < keep:
            kept.update(s.seq_id for s in group)
        seqs += group
    while engine.scheduler.has_work():
        engine.step()
    mine = [s for s in seqs if s.seq_id in kept]
    return Recorded([s.output_ids for s in mine], [record.of(s) for s in mine], engine)

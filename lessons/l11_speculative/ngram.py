"""Prompt lookup: guess that the text goes on as it went on after the last time it looked like this.

Find the most recent earlier occurrence of the request's last n tokens (n from max_n down to min_n) in
its own prompt and output, and propose the tokens that followed it. No second model and no second pool:
it pays off when output repeats input (code edits, quoting, summaries that copy names) and costs a few
wasted query rows when it does not. An index per request (in `seq.extra`) maps each n-gram to where it
last ended; each step adds the positions committed since the last one, so a lookup never rescans the history.
"""
from __future__ import annotations

from lessons.l8_chunked_prefill.slice import Slice
from lessons.l11_speculative.drafter import Draft
from shared.errors import CourseError


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise CourseError(f"n-gram sizes need 1 <= min ({min_n}) <= max ({max_n})")
        self.max_n, self.min_n = max_n, min_n

    def bind(self, engine) -> None:
        pass

    def propose(self, decodes: list[Slice], limits: list[int]) -> list[Draft]:
        return [Draft(self.lookup(piece, k) if k else []) for piece, k in zip(decodes, limits)]

    # Task L11.1: prompt lookup: up to k tokens that followed the latest earlier match of the last n (max_n .. min_n) tokens
    def lookup(self, piece: Slice, k: int) -> list[int]:
        seq, n = piece.seq, piece.seq.num_tokens
        index, indexed, tokens = seq.extra.setdefault("ngram", ({}, 0, []))
        # Index every n-gram ending before the last token: the suffix itself must find an *earlier* one.
        tokens += seq.token_ids(len(tokens), n)  # this request's tokens, copied once each
        for end in range(indexed, n - 1):
            for size in range(self.min_n, min(self.max_n, end + 1) + 1):
                index[tuple(tokens[end - size + 1:end + 1])] = end
        seq.extra["ngram"] = (index, max(indexed, n - 1), tokens)
        for size in range(min(self.max_n, n), self.min_n - 1, -1):
            end = index.get(tuple(tokens[n - size:]))
            if end is not None:
                return tokens[end + 1:min(end + 1 + k, n)]
        return []

"""A draft model: a smaller Qwen3 with the same tokenizer guesses k tokens, one forward per guess.

It runs through L3's runner over a pool of its own that is indexed by the target's block tables: block b
of the draft pool holds the draft model's K/V for the same positions block b of the target pool holds
(vLLM v0 kept the two in lockstep the same way). So the draft needs no allocator, no tables, and no
rollback of its own: when the target drops blocks, the draft's rows in them are dropped with them.

What the draft pool holds for a request is trusted only up to where it is known to be right, kept in
`seq.extra["draft"]`: the positions it wrote whose tokens the target then kept, and not past the first
block the target's table no longer shares with the table it wrote through (copy-on-write, preemption,
rollback). Each proposal first feeds the draft everything past that point (the tokens the target kept
last step, or a whole prompt after admission or preemption), then one token per further guess. A wrong
draft pool can only cost acceptance, never a token: the target checks every guess.
"""
from __future__ import annotations

import torch

from lessons.l3_block_tensor.runner import PagedRunner
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l11_speculative.drafter import Draft
from lessons.l11_speculative.slice import VerifySlice
from shared.errors import CourseError
from shared.model import Qwen3ForCausalLM


class DraftModelDrafter:
    name = "draft"

    def __init__(self, model: Qwen3ForCausalLM, backend: str = "auto"):
        self.model, self.backend = model, backend
        self.runner: PagedRunner | None = None
        self.forwards = 0  # draft-model forwards run (k per step with drafts, the first one with catch-up)

    def bind(self, engine) -> None:
        target = engine.model.full_config if hasattr(engine.model, "full_config") else engine.model.config
        draft = self.model.config
        if draft.vocab_size != target.vocab_size:
            raise CourseError(f"the draft model's vocabulary ({draft.vocab_size}) is not the target's "
                              f"({target.vocab_size}): it must use the same tokenizer")
        if draft.max_position_embeddings < target.max_position_embeddings:
            raise CourseError(f"the draft model's context ({draft.max_position_embeddings}) is shorter than the "
                              f"target's ({target.max_position_embeddings})")
        # As many blocks as the target's pool (its dummy block included), so every target block id is valid here.
        self.runner = PagedRunner(self.model, engine.block_size, engine.runner.pool.num_blocks, self.backend)

    # Task L11.8: a draft model: k greedy guesses, one forward each, through a pool indexed by the target's block tables
    def propose(self, decodes: list[Slice], limits: list[int]) -> list[Draft]:
        """k greedy guesses per request (a one-hot q), all requests in each of the k forwards."""
        drafts: list[list[int]] = [[] for _ in decodes]
        views = [self.catch_up(piece) for piece in decodes]
        active = list(range(len(decodes)))
        while active:
            logits = self.runner.forward([views[i] for i in active])  # each view's last row: the next guess
            self.forwards += 1
            for i, token in zip(active, logits.argmax(dim=-1).tolist()):
                drafts[i].append(token)
            active = [i for i in active if len(drafts[i]) < limits[i]]
            for i in active:  # feed the guess just made: one more position, one token
                views[i] = VerifySlice.of_decode(decodes[i], drafts[i])
                views[i].num_cached = decodes[i].seq.num_tokens + len(drafts[i]) - 1
        for piece, tokens in zip(decodes, drafts):
            seq = piece.seq
            # Written: every position below n + k - 1 (the last guess is never fed). Kept only if the target keeps it.
            seq.extra["draft"] = (seq.blocks, seq.num_tokens, tokens[:-1])
        return [Draft(tokens) for tokens in drafts]

    # Task L11.8: a draft model: k greedy guesses, one forward each, through a pool indexed by the target's block tables
    def catch_up(self, piece: Slice) -> VerifySlice:
        """The decode's slice as the draft model must feed it: from the first position its pool does not
        hold for this request up to the last committed token (n - 1)."""
        seq = piece.seq
        view = VerifySlice.of_decode(piece, [])
        view.num_cached = min(self.trusted(seq), seq.num_tokens - 1)
        return view

    # Task L11.8: a draft model: k greedy guesses, one forward each, through a pool indexed by the target's block tables
    def trusted(self, seq) -> int:
        """Positions 0 .. trusted-1 of the draft pool hold the draft model's K/V of this request's tokens."""
        state = seq.extra.get("draft")
        if state is None:
            return 0
        blocks, start, fed = state  # fed[j] was written at position start + j
        kept = seq.token_ids(start, start + len(fed))
        right = next((j for j, (a, b) in enumerate(zip(fed, kept)) if a != b), min(len(fed), len(kept)))
        written = start + right
        if blocks is not seq.blocks:  # a new table: trust only the blocks both tables share, from the start
            m = min(len(blocks), len(seq.blocks))
            same = m if blocks[:m] == seq.blocks[:m] else next(i for i in range(m) if blocks[i] != seq.blocks[i])
            written = min(written, same * seq.block_size)
        return written

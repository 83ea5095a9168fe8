"""L13's engine: L12's, with requests whose output must match a grammar (JSON schema, regex, choices).

Each output with a grammar has its own matcher (llguidance), created at its first sampled row and kept in
`seq.extra["matcher"]`. Every step, before L11's `choose` samples, each constrained row's logits lose every
token the matcher forbids; after it, the matcher takes in the tokens kept. A verify slice (L11) has one row
per draft: its rows are masked from the matcher walked through the drafts, and the drafts the target rejects
are rolled back. When the grammar is complete the mask allows only EOS, and EOS ends the output even with
ignore_eos. Rows without a grammar are not touched: a step with none is L12's step exactly.
"""
from __future__ import annotations

import time
from dataclasses import replace

import llguidance
import torch

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l11_speculative.slice import VerifySlice
from lessons.l12_kv_quant.engine import L12Engine, L12TpEngine
from lessons.l13_structured import mask
from lessons.l13_structured.sampling import grammar_of
from shared.errors import CourseError
from shared.generation import StopRule

Group = tuple[SharedSequence, range, Slice]  # a sequence, its rows of the step's logits, the slice that fed them


class L13Engine(L12Engine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mask_seconds = 0.0  # spent filling and applying masks (the benchmark reads it)
        self.masked_rows = 0

    # Task L13.7: mask constrained rows (verify rows after their drafts) before sampling; advance the matchers
    def add_parallel(self, prompt_ids: list[int], stop: StopRule, sampling: SamplingParams = SamplingParams(),
                     n: int = 1) -> list[SharedSequence]:
        grammar = grammar_of(sampling)
        if grammar is not None:
            if grammar.vocab_size != self.model.config.vocab_size:
                raise CourseError(f"the grammar was compiled for a vocabulary of {grammar.vocab_size} tokens; "
                                  f"this model has {self.model.config.vocab_size}")
            # the grammar's end is the output's end: its EOS stops the request, ignore_eos or not
            sampling = replace(sampling, stop_token_ids=sampling.stop_token_ids | grammar.eos_ids)
        return super().add_parallel(prompt_ids, stop, sampling, n)

    # Task L13.7: mask constrained rows (verify rows after their drafts) before sampling; advance the matchers
    def choose(self, logits: torch.Tensor, groups: list[Group]) -> list[list[int]]:
        constrained = [i for i, (seq, _, _) in enumerate(groups) if grammar_of(seq.sampling) is not None]
        if not constrained:
            return super().choose(logits, groups)
        taken = self.mask_rows(logits, [groups[i] for i in constrained])
        emitted = super().choose(logits, groups)
        for i, drafts_taken in zip(constrained, taken):
            advance(matcher_of(groups[i][0]), emitted[i], drafts_taken)
        return emitted

    # Task L13.7: mask constrained rows (verify rows after their drafts) before sampling; advance the matchers
    @torch.inference_mode()  # the logits are the runner's inference tensor: written in place
    def mask_rows(self, logits: torch.Tensor, groups: list[Group]) -> list[int]:
        """Mask every row these groups sample from, in place. A plain row gets its matcher's mask; a verify
        slice's row j gets the mask after drafts 1..j, as long as those drafts are allowed (past the first
        forbidden draft the target's masked choice differs from it, so later rows are never read). Returns,
        per group, how many drafts its matcher took in: the caller rolls back those the target rejects."""
        start = time.perf_counter()
        bitmask = mask.allocate(sum(len(rows) for _, rows, _ in groups), logits.shape[-1])
        masked: list[int] = []  # the logits row each bitmask row belongs to
        taken = []
        for seq, rows, piece in groups:
            matcher = matcher_of(seq)
            drafts = piece.drafts if isinstance(piece, VerifySlice) and seq is piece.seq else []
            rows = rows if drafts else range(rows.stop - 1, rows.stop)  # a plain group samples its last row
            count = 0
            for j, row in enumerate(rows):
                words = len(masked)
                mask.fill(matcher, bitmask, words)
                masked.append(row)
                if j == len(drafts) or not mask.is_allowed(bitmask[words], drafts[j]):
                    break
                matcher.consume_token(drafts[j])
                count += 1
            taken.append(count)
        if masked == list(range(len(logits))):  # every row once, in order (all constrained): in place
            mask.apply(logits, bitmask)
        else:  # copy the rows out and back (siblings, n > 1, share their parent's row and mask it alike)
            index = torch.tensor(masked, device=logits.device)
            rows = logits.index_select(0, index)
            mask.apply(rows, bitmask[:len(masked)])
            logits.index_copy_(0, index, rows)
        self.mask_seconds += time.perf_counter() - start
        self.masked_rows += len(masked)
        return taken


# Task L13.6: a matcher per output; roll back rejected drafts, then take the target's token
def matcher_of(seq: SharedSequence) -> llguidance.LLMatcher:
    """The output's own matcher: made at its first sampled row (each of L6's siblings makes its own), from its
    tokens so far (none, unless it was built again). L5's recompute keeps `extra`, so the state survives it."""
    matcher = seq.extra.get("matcher")
    if matcher is None:
        matcher = grammar_of(seq.sampling).matcher()
        matcher.consume_tokens(seq.output_ids)
        seq.extra["matcher"] = matcher
    return matcher


# Task L13.6: a matcher per output; roll back rejected drafts, then take the target's token
def advance(matcher: llguidance.LLMatcher, tokens: list[int], drafts_taken: int) -> None:
    """After the step: `tokens` are the accepted drafts, then the target's own. The drafts the matcher took in
    beyond the accepted ones are rolled back; then the target's token goes in (the mask allowed it)."""
    rejected = drafts_taken - (len(tokens) - 1)
    if rejected:
        matcher.rollback(rejected)
    matcher.consume_token(tokens[-1])


class L13TpEngine(L13Engine, L12TpEngine):
    """The same over L10's split model: masks and matchers live on rank 0, where the sampler is."""

"""L11's engine: L9's (L8's scheduler, abort, bounded histories), with drafts checked in the decode rows.

One step: L8's plan -> drafts for its decodes (the drafter) -> one forward, every draft a query row ->
the verify rule per decode -> commit the kept tokens, cut at any stop -> roll the pages back to what was
kept -> register only verified blocks -> retire the finished. With no drafter (or K = 0) every step is
exactly L9's. L11TpEngine is the same step over L10's split model.
"""
from __future__ import annotations

import torch

from lessons.l4_continuous.sampling import sample
from lessons.l6_prefix_sharing.scheduler import PrefixScheduler
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l9_server.engine import L9Engine
from lessons.l10_tensor_parallel.engine import L10Engine
from lessons.l11_speculative.drafter import Drafter
from lessons.l11_speculative.scheduler import SpecScheduler
from lessons.l11_speculative.slice import VerifySlice
from lessons.l11_speculative.stats import SpecStats
from lessons.l11_speculative.verify import accept_one_hot, accept_sampled, keep_while_equal
from shared.errors import CourseError

DEFAULT_NUM_SPECULATIVE_TOKENS = 4


def check_num_speculative_tokens(k: object) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise CourseError(f"num-speculative-tokens must be an integer of at least 0, got {k!r}")


class L11Engine(L9Engine):
    def __init__(self, *args, drafter: Drafter | None = None,
                 num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS, **kwargs):
        check_num_speculative_tokens(num_speculative_tokens)
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens if drafter is not None else 0
        self.spec = SpecStats()
        super().__init__(*args, **kwargs)
        if drafter is not None:
            drafter.bind(self)

    def make_scheduler(self, max_running: int) -> PrefixScheduler:
        super().make_scheduler(max_running)  # L6's stats, prefix cache and ref-counted manager (L8's scheduler, unused)
        return SpecScheduler(self.allocator, self.block_size, max_running, self.stats, self.wait_for_inflight,
                             self.max_batched_tokens, self.max_slice_tokens, self.max_long_prefills,
                             self.long_prefill_threshold, num_speculative_tokens=self.num_speculative_tokens)

    # Task L11.7: the step: drafts -> one forward -> verify each decode -> commit, cut at a stop -> roll back -> register
    def step(self) -> list[SharedSequence]:
        """L8's plan with drafts behind its decodes -> one forward -> keep what verifies -> roll the rest back."""
        self.clock += 1
        plan = self.scheduler.schedule()
        if not plan:
            return []
        plan = self.with_drafts(plan, self.scheduler.limits)
        self.step_tokens.append(sum(piece.num_tokens - piece.num_cached for piece in plan))
        widths = [piece.num_tokens - piece.num_cached if piece.decode else 1 for piece in plan]  # logits rows each
        logits = self.runner.forward(plan)  # every row of a decode, the last row of a prompt slice that samples
        batch = [piece.seq for piece in plan]
        for piece in plan:
            if not piece.decode:
                piece.seq.num_cached = piece.num_cached  # a prompt slice: all it fed is real
                self.prompt_slices[piece.seq_id] = self.prompt_slices.get(piece.seq_id, 0) + 1
        self.scheduler.register_written([p.seq for p in plan if not p.decode])  # decodes: after verification

        groups: list[tuple[SharedSequence, range, Slice]] = []  # (sequence, its rows of `logits`, its slice)
        row = 0
        for piece, width in zip(plan, widths):
            if not piece.samples:
                continue
            rows = range(row, row + width)
            row += width
            groups.append((piece.seq, rows, piece))
            for child in self.scheduler.fork(piece.seq):  # n > 1: siblings sample from the parent's prompt row
                groups.append((child, rows, piece))
        emitted = self.choose(logits, groups)

        last, kept, decodes = self.commit(groups, emitted)
        self.stats.record(batch, self.allocator.num_blocks - self.allocator.num_free, self.block_size)
        self.scheduler.register_written(decodes)  # num_cached now counts verified tokens only
        sampled = [seq for seq, _, _ in groups]
        finished = self.scheduler.postprocess(sampled, last)
        now = self.timer()
        for (seq, _, _), count in zip(groups, kept):
            for _ in range(count):  # every token of the step came at its end
                self.timing[seq.seq_id].stamp(self.clock, now)
        self.trim_histories()
        return finished

    # Task L11.7: the step: drafts -> one forward -> verify each decode -> commit, cut at a stop -> roll back -> register
    def commit(self, groups: list[tuple[SharedSequence, range, Slice]],
               emitted: list[list[int]]) -> tuple[list[int], list[int], list[SharedSequence]]:
        """Append each sequence's tokens but its last (postprocess appends that one and retires the finished),
        stopping at the first that finishes it; roll every decode back to what it kept. Returns the last tokens,
        how many tokens each sequence got, and the decodes (their verified blocks are registered next)."""
        last, kept, decodes = [], [], []
        for (seq, _, piece), tokens in zip(groups, emitted):
            before = len(seq.output_ids)
            for token in tokens:  # one at a time: a stop inside the kept drafts ends the output there
                seq.output_ids.append(token)
                if seq.is_finished():
                    break
            kept.append(len(seq.output_ids) - before)
            last.append(seq.output_ids.pop())
            if piece.decode and seq is piece.seq:
                self.spec.record(len(getattr(piece, "drafts", ())), len(tokens) - 1, len(tokens))
                self.scheduler.roll_back(seq, seq.num_tokens + 1)  # its history: what it kept, then `last`
                decodes.append(seq)
        return last, kept, decodes

    # Task L11.7: the step: drafts -> one forward -> verify each decode -> commit, cut at a stop -> roll back -> register
    def with_drafts(self, plan: list[Slice], limits: list[int]) -> list[Slice]:
        """Each decode with room for drafts asks the drafter, and becomes a verify slice if it got any."""
        asked = [i for i, k in enumerate(limits) if k]
        if not asked:
            return plan
        drafts = self.drafter.propose([plan[i] for i in asked], [limits[i] for i in asked])
        plan = list(plan)
        for i, draft in zip(asked, drafts):
            k = min(len(draft.tokens), limits[i])
            if k:
                probs = None if draft.probs is None else draft.probs[:k]
                plan[i] = VerifySlice.of_decode(plan[i], draft.tokens[:k], probs)
        return plan

    # Task L11.7: the step: drafts -> one forward -> verify each decode -> commit, cut at a stop -> roll back -> register
    def choose(self, logits: torch.Tensor, groups: list[tuple[SharedSequence, range, Slice]]) -> list[list[int]]:
        """Per sequence, the tokens to append: one for a prompt's end or a plain decode, 1 .. k+1 for a verify
        slice (the accepted drafts, then the target's own)."""
        if all(seq.sampling.greedy for seq, _, _ in groups):  # the common case: one argmax for the whole step
            targets = logits.argmax(dim=-1).tolist()
            return [keep_while_equal(getattr(piece, "drafts", []), targets[rows.start:rows.stop])
                    for _, rows, piece in groups]
        out: list[list[int]] = [[] for _ in groups]
        plain = [i for i, (_, _, piece) in enumerate(groups) if not isinstance(piece, VerifySlice)]
        if plain:  # sampled together, as L4 does: each row still draws from its own request's generator
            last_rows = [groups[i][1].stop - 1 for i in plain]
            seqs = [groups[i][0] for i in plain]
            rows = logits if last_rows == list(range(len(logits))) else logits[last_rows]
            for i, token in zip(plain, sample(rows, [s.sampling for s in seqs], [s.generator for s in seqs])):
                out[i] = [token]
        for i, (seq, rows, piece) in enumerate(groups):
            if isinstance(piece, VerifySlice):
                mine = logits[rows.start:rows.stop]
                if piece.draft_probs is None or seq.sampling.greedy:
                    out[i] = accept_one_hot(mine, piece.drafts, seq.sampling, seq.generator)
                else:
                    out[i] = accept_sampled(mine, piece.drafts, piece.draft_probs, seq.sampling, seq.generator)
        return out


class L11TpEngine(L11Engine, L10Engine):
    """The same step on a model split across ranks: L10's runner sends each verify slice (its drafts are
    tokens like any other) and every rank scores the same rows; the drafter runs on rank 0 only."""

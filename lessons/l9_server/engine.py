"""L9's engine: L8's, plus abort and forget, and a step that keeps bounded histories. A server's requests can
leave at any moment, not only when they finish, and the server runs for days."""
from __future__ import annotations

from lessons.l4_continuous.sequence import Status
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l8_chunked_prefill.engine import L8Engine


HISTORY_STEPS = 1024  # per-step records kept (the stats' lists, L8's step_tokens): the latest ones only


class L9Engine(L8Engine):
    def step(self) -> list[SharedSequence]:
        finished = super().step()
        self.trim_histories()
        return finished

    def trim_histories(self) -> None:
        for history in (self.step_tokens, self.stats.tokens_held, self.stats.slots_reserved, self.stats.running,
                         self.stats.timeline):
            del history[:-HISTORY_STEPS]  # a server steps for days; a batch script could keep them all

    # Task L9.5: abort sequences wherever they are (waiting, mid-prompt, decoding, unforked): their blocks go back
    def abort(self, seqs: list[SharedSequence]) -> None:
        """End these sequences now, wherever they are: waiting, part-way through their prompt, decoding, or
        not yet forked (a parent is aborted only with its siblings, or after it forked them). Called between
        steps, never inside one, so no plan holds them. Their block references go back to the pool; blocks
        already registered in the prefix cache stay cached, unreferenced."""
        for seq in seqs:
            if seq.status is Status.FINISHED:
                continue
            if seq in self.scheduler.waiting:
                self.scheduler.waiting.remove(seq)  # a waiting request holds no blocks (L6 is recompute-only)
            elif seq in self.scheduler.running:
                self.scheduler.running.remove(seq)  # `running` stays in arrival order: L5's victim rule holds
                self.allocator.free(seq.blocks)
            # else: a sibling not yet forked, held only in its parent's "forks" list, which holds no blocks
            seq.extra.pop("forks", None)  # an aborted parent must not fork later (its siblings are aborted too)
            seq.blocks = []
            seq.status, seq.finished_at = Status.FINISHED, self.scheduler.step_no
        for seq in seqs:
            self.forget(seq.seq_id)

    # Task L9.5: abort sequences wherever they are (waiting, mid-prompt, decoding, unforked): their blocks go back
    def forget(self, seq_id: int) -> None:
        """Drop L8's per-request records: a server runs for days, and they would grow with every request."""
        self.timing.pop(seq_id, None)
        self.prompt_slices.pop(seq_id, None)

"""Block tables across ranks: rank 0 sends each step only what the followers' copies lack.

Every rank needs every slice's block table (its attention reads the same block ids in its own pool), but
a table grows by one entry every block_size tokens while a 32k-token request's table is 2,048 entries:
sending it whole every step would make each step's message, and each follower's work to read it, grow
with the history. So each follower keeps a copy of the tables of the last step's requests, and rank 0
sends, per slice, the entries from where that copy ends (`table_from`).

This rests on the rule every lesson keeps (L4's table_tensor.py): a table list is only ever appended to;
any other change assigns a new list. So rank 0 sends the tail of a list it sent last step (same object),
and the whole of any other (new, or a request the last step did not run). Both sides keep only the
tables of the last step's requests, so neither has to be told when a request ends. A copy that has
drifted is caught cheaply: its length must be where the tail starts, and its last entry rank 0's.
"""
from __future__ import annotations

from lessons.l4_continuous.table_tensor import TableTensor
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l10_tensor_parallel.wire import SentSlice
from shared.errors import RunFailure


class SentTables:
    """Rank 0: the table list of each request of the last step, and how many entries of it were sent."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[list[int], int]] = {}

    # Task L10.6: block tables across ranks: send each step only the entries a follower's copy lacks, join them
    def starts(self, slices: list[Slice]) -> list[int]:
        """Per slice, the first entry of its table the followers lack. Records this step as sent."""
        starts, sent = [], {}
        for s in slices:
            last = self.sent.get(s.seq_id)
            same = last is not None and last[0] is s.blocks and last[1] <= len(s.blocks)
            starts.append(last[1] if same else 0)
            sent[s.seq_id] = (s.blocks, len(s.blocks))
        self.sent = sent
        return starts


class KeptTables:
    """A follower: its copy of each table of the last step (the list, and its int32 tensor for BatchMeta)."""

    def __init__(self) -> None:
        self.kept: dict[int, tuple[list[int], TableTensor]] = {}

    # Task L10.6: block tables across ranks: send each step only the entries a follower's copy lacks, join them
    def join(self, slices: list[SentSlice]) -> list[SentSlice]:
        """Give each slice its whole table: the kept copy extended by the tail sent. Raises RunFailure when a
        copy is not where rank 0's table says it is (the ranks would attend over different blocks)."""
        kept = {}
        for s in slices:
            if s.seq_id in kept:
                raise RunFailure(f"tensor-parallel follower: request {s.seq_id} twice in one step")
            blocks, table = self.kept.get(s.seq_id, ([], TableTensor()))
            if s.table_from == 0:
                blocks = s.blocks  # the whole table: a new list (the kept tensor notices and starts over)
            elif len(blocks) != s.table_from:
                raise RunFailure(f"tensor-parallel follower: request {s.seq_id}'s block table is sent from entry "
                                 f"{s.table_from}, but this rank holds {len(blocks)} entries of it")
            else:
                blocks.extend(s.blocks)  # appended in place, as rank 0's list was
            if blocks[-1] != s.last_block:
                raise RunFailure(f"tensor-parallel follower: request {s.seq_id}'s block table ends with block "
                                 f"{blocks[-1]} here and {s.last_block} on rank 0")
            s.blocks, s.table = blocks, table
            kept[s.seq_id] = (blocks, table)
        self.kept = kept
        return slices

"""Host work per decode step must not grow with the history: the mechanisms, counted, never timed.

scripts/benchmark/host_overhead.py measures the time; these tests pin down why it is flat. A decode step
copies no request's token list (the slice holds the request's own lists; only the fed token is read),
converts no whole block table (each request keeps an int32 tensor that grows by appending), and L10
sends each step only the block-table entries a follower's copy lacks.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l4_continuous.sequence import Sequence
from lessons.l4_continuous.table_tensor import TableTensor
from lessons.l6_prefix_sharing.block_manager import RefBlockManager
from lessons.l6_prefix_sharing.prefix_cache import PrefixCache
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l6_prefix_sharing.stats import PrefixStats
from lessons.l8_chunked_prefill import L8Engine
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l10_tensor_parallel.tables import KeptTables, SentTables
from lessons.l10_tensor_parallel.wire import pack, unpack
from shared.errors import RunFailure
from shared.generation import StopRule

CPU = torch.device("cpu")
S = 16


class CountingList(list):
    """A token list that counts the elements every copy of it touches (slices, joins, full iteration)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.touched = 0

    def __getitem__(self, i):
        got = super().__getitem__(i)
        if isinstance(i, slice):
            self.touched += len(got)
        return got

    def __add__(self, other):
        self.touched += len(self) + len(other)
        return list(self) + list(other)

    def __iter__(self):
        self.touched += len(self)
        return super().__iter__()


def decoding(history: int, seq_id: int = 0) -> Sequence:
    """A request one token behind after `history` computed tokens, its table reserved for the next one."""
    rng = random.Random(history + seq_id)
    seq = Sequence([rng.randrange(1000) for _ in range(history)], S, seq_id=seq_id)
    seq.output_ids.append(7)
    seq.num_cached = history
    seq.blocks = list(range(seq_id * 10_000, seq_id * 10_000 + -(-seq.num_tokens // S)))
    return seq


def test_a_decode_slice_holds_the_request_lists_and_reads_one_token():
    seq = decoding(5000)
    seq.prompt_ids, seq.output_ids = CountingList(seq.prompt_ids), CountingList(seq.output_ids)
    piece = Slice.of(seq, 1, decode=True)
    assert piece.prompt_ids is seq.prompt_ids and piece.output_ids is seq.output_ids, "the slice copied the tokens"
    assert (piece.num_cached, piece.num_tokens) == (5000, 5001) and piece.samples
    assert piece.token_ids(piece.num_cached, piece.num_tokens) == [7]
    assert seq.prompt_ids.touched + seq.output_ids.touched <= 1, "more than the fed token was copied"
    # A prompt slice cut short: its tokens are the request's, up to its end only.
    seq.num_cached, seq.output_ids = 100, []
    part = Slice.of(seq, 30)
    assert part.num_tokens == 130 and not part.samples
    assert part.token_ids(100, 130) == seq.prompt_ids[100:130]


def converted_by_second_build(history: int, monkeypatch) -> int:
    """Ints turned into tensors by BatchMeta.build for 4 decoding requests, the step after one where each
    request's table grew by a block (the first build converted the whole tables)."""
    seqs = [decoding(history, seq_id=i) for i in range(4)]  # history + 1 tokens: a multiple of S
    BatchMeta.build(seqs, S, CPU)
    for seq in seqs:  # one more step: the request fed its token, sampled the next, and opened a block
        seq.num_cached += 1
        seq.output_ids.append(8)
        seq.blocks += [seq.blocks[-1] + 1]
    converted = [0]
    real = torch.tensor

    def counting(data, *args, **kwargs):
        converted[0] += len(data) if isinstance(data, (list, tuple, range)) else 1
        return real(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    meta = BatchMeta.build(seqs, S, CPU)
    monkeypatch.setattr(torch, "tensor", real)
    want = torch.tensor([b for s in seqs for b in s.blocks[:-(-s.num_tokens // S)]], dtype=torch.int32)
    assert torch.equal(meta.kv_indices, want)
    return converted[0]


def test_batch_meta_converts_only_what_a_step_appended(monkeypatch):
    short, long = converted_by_second_build(1023, monkeypatch), converted_by_second_build(8191, monkeypatch)
    assert short == long, f"{short} ints converted at a 1k history, {long} at 8k: the tables were converted whole"


def test_table_tensor_grows_by_appending_and_starts_over_for_a_new_list():
    blocks = list(range(100, 140))
    table = TableTensor()
    assert torch.equal(table.first(blocks, 40), torch.arange(100, 140, dtype=torch.int32))
    blocks.append(7)
    assert torch.equal(table.first(blocks, 41)[-2:], torch.tensor([139, 7], dtype=torch.int32))
    assert table.ids.numel() == 80, "full: the capacity doubles, so a long table is copied O(log n) times"
    storage = table.ids.data_ptr()
    blocks += [8, 9]
    assert table.first(blocks, 43)[-3:].tolist() == [7, 8, 9]
    assert table.ids.data_ptr() == storage and table.filled == 43, "appended in place"
    other = [1, 2, 3]  # a new list (a re-admission, a fork): copied whole, whatever the old one held
    assert table.first(other, 3).tolist() == [1, 2, 3]
    other[2] = 30  # the rule broken (an entry replaced in place): the last entry mirrored is checked each call
    assert table.first(other, 3).tolist() == [1, 2, 30]


def test_copy_on_write_gives_the_table_a_new_list_so_its_tensor_cannot_go_stale():
    """TableTensor trusts that a list is only appended to. Copy-on-write replaces an entry: it must make a new
    list, or the tensor would keep the shared block and the request would write into its sibling's."""
    manager = RefBlockManager(8, PrefixCache(), PrefixStats(), pool=None)
    manager.copy_block = lambda src, dst: None  # no pool here: only the table is under test
    parent = SharedSequence(list(range(20)), 4, seq_id=0)
    parent.blocks, parent.num_cached = manager.alloc(5), 18  # the last block partly filled
    child = SharedSequence(list(range(20)), 4, seq_id=1, num_cached=18)
    manager.share(parent.blocks)
    child.blocks = list(parent.blocks)
    before = child.blocks
    assert child.block_table_tensor(5).tolist() == before
    child.reserve(19, manager)  # writes into the shared partial block: copies it first
    assert child.blocks is not before and child.blocks[4] != parent.blocks[4]
    assert child.block_table_tensor(5).tolist() == child.blocks


def test_an_l8_decode_step_touches_no_history(tiny_model):
    """A whole L8 engine step (scheduler, slices, the graph path's buffers, metadata, sampling, bookkeeping)
    on two decoding requests copies the same number of token ids at a 70-token and a 700-token history."""
    touched = {}
    for history in (70, 700):
        engine = L8Engine(tiny_model, S, 2 * (history // S + 4), max_running=2, backend="torch",
                          max_batched_tokens=2 * history)
        rng = random.Random(history)
        seqs = [engine.add_request([rng.randrange(1000) for _ in range(history + i)], StopRule(8)) for i in range(2)]
        while not all(s.output_ids for s in seqs):
            engine.step()  # the prompts
        engine.step()  # one decode, so the step below is a decode that opens no block and fills none
        assert all(s.num_tokens % S not in (0, 1) for s in seqs)
        for s in seqs:
            s.prompt_ids, s.output_ids = CountingList(s.prompt_ids), CountingList(s.output_ids)
        engine.step()
        assert engine.runner.replays, "the decode step ran on the static buffers"
        touched[history] = sum(s.prompt_ids.touched + s.output_ids.touched for s in seqs)
    assert touched[70] == touched[700] <= 4, touched


def step_message(tables: SentTables, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    slices = [Slice.of(s, 1, decode=True) for s in seqs]
    return pack("run_step", slices, [], tables.starts(slices))


def advance(seqs: list[Sequence]) -> None:
    for s in seqs:
        s.num_cached += 1
        s.output_ids.append(9)
        if s.num_tokens > len(s.blocks) * S:
            s.blocks.append(s.blocks[-1] + 1)


@pytest.mark.parametrize("steps", [1, S + 3])
def test_l10_step_message_does_not_grow_with_history_and_the_follower_rebuilds_the_tables(steps):
    sizes = {}
    for history in (1024, 8192):  # the same phase in their blocks: a step opens a block in both or neither
        seqs = [decoding(history + i, seq_id=i) for i in range(3)]
        sent, kept = SentTables(), KeptTables()
        first = step_message(sent, seqs)
        kept.join(unpack(*first)[1])
        for _ in range(steps):
            advance(seqs)
            header, payload = step_message(sent, seqs)
            got = kept.join(unpack(header, payload)[1])
            assert [g.blocks for g in got] == [s.blocks for s in seqs], "the follower's tables drifted"
            meta = BatchMeta.build(got, S, CPU)
            assert torch.equal(meta.kv_indices, BatchMeta.build(seqs, S, CPU).kv_indices)
        sizes[history] = (first[1].numel(), payload.numel())
    assert sizes[8192][0] > sizes[1024][0], "the first step sends the whole tables"
    assert sizes[8192][1] == sizes[1024][1], f"a later step's message grew with the history: {sizes}"


def test_l10_a_follower_copy_that_drifted_is_caught():
    seqs = [decoding(100, seq_id=1)]
    sent, kept = SentTables(), KeptTables()
    kept.join(unpack(*step_message(sent, seqs))[1])
    advance(seqs)
    kept.kept[1][0].append(999)  # the follower's copy one entry longer than rank 0's
    with pytest.raises(RunFailure, match="sent from entry 7, but this rank holds 8"):
        kept.join(unpack(*step_message(sent, seqs))[1])
    sent, kept = SentTables(), KeptTables()
    kept.join(unpack(*step_message(sent, seqs))[1])
    seqs[0].blocks[-1] = 555  # edited in place: the rule every lesson keeps, broken
    with pytest.raises(RunFailure, match="ends with block 10006 here and 555 on rank 0"):
        kept.join(unpack(*step_message(sent, seqs))[1])
    # A request the last step did not run (preempted, or skipped by the budget) travels whole again.
    sent.starts([])
    header, payload = step_message(sent, seqs)
    assert unpack(header, payload)[1][0].table_from == 0


def run_script(*args: str) -> subprocess.CompletedProcess:
    script = Path(__file__).resolve().parents[1] / "scripts" / "benchmark" / "host_overhead.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow  # the benchmark's own tiny run
def test_the_benchmark_runs_small_and_says_what_it_measured():
    """The benchmark's own path at toy sizes: it defines host time, prints its conditions and one row per point.
    (Its figures are read by a person; no test looks at them.)"""
    out = run_script("--lessons", "l4,l8", "--histories", "40,80", "--share-histories", "", "--steps", "2",
                     "--warmup", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    assert "host time = wall time of engine.step() minus the time inside model.forward" in text
    # the harness's conditions line, with the backend the engines really used (not the "auto" asked for)
    line = next(x for x in out.stdout.splitlines() if x.startswith("conditions"))
    assert " · threads 1 · " in line and " · backend auto" not in line and " · load " in line
    for lesson in ("l4", "l8"):
        for history in (40, 80):
            assert f"{lesson} history {history}: host" in text


@pytest.mark.parametrize("args,message", [
    (["--lessons", "l9"], "--lessons: unknown lesson 'l9'"),
    (["--histories", "1k"], "--histories must be comma-separated integers, got '1k'"),
    (["--steps", "0"], "--steps, --threads and --tp must be at least 1"),
])
def test_the_benchmark_refuses_bad_options_in_one_line(args, message):
    out = run_script(*args)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert message in out.stderr

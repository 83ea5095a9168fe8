"""L10's build-track tests for the block tables across ranks, a follower's step and the follower loop, in one process
(scripts/course.py check L10); the layout's, the layers', the model's and the wire's are in test_l10_units.py and
test_l10_control.py.

- SentTables and KeptTables through wire.py's tensors: a follower's copy of every table equals rank 0's after each
  step, and each step sends only the entries that copy lacks; a copy that drifted is one RunFailure.
- Rank 0 is an L10Engine at tp 1 (a group of one: nothing to send) whose group also keeps each call it leads as
  the int64 tensors wire.py would broadcast. A follower's runner fed the unpacked steps, then `follow` itself fed
  every message, must end with a KV pool equal to rank 0's, the deferred copy-on-write copies included.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Sequence
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l10_tensor_parallel import L10Engine
from lessons.l10_tensor_parallel.follower import follow
from lessons.l10_tensor_parallel.group import TpGroup
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM
from lessons.l10_tensor_parallel.runner import TpRunner
from lessons.l10_tensor_parallel.tables import KeptTables, SentTables
from lessons.l10_tensor_parallel.wire import pack, unpack
from shared.errors import RunFailure
from shared.generation import StopRule

CPU = torch.device("cpu")


# --- L10.6: block tables across ranks ---


class TwoRanks:
    """Rank 0's SentTables and a follower's KeptTables, a step's message packed and unpacked between them."""

    def __init__(self) -> None:
        self.sent, self.kept = SentTables(), KeptTables()

    def step(self, seqs: list[Sequence]) -> list[int]:
        """One decode step of these requests; returns the first table entry sent for each (its `start`)."""
        slices = [Slice.of(s, 1, decode=True) for s in seqs]
        starts = self.sent.starts(slices)
        got = self.kept.join(unpack(*pack("run_step", slices, [], starts))[1])
        for s, g in zip(seqs, got, strict=True):
            assert g.blocks == s.blocks, (f"request {s.seq_id}: the follower's joined table is {g.blocks}, rank 0's is "
                                          f"{s.blocks}")
        return starts

    @staticmethod
    def advance(seqs: list[Sequence]) -> None:
        for s in seqs:
            s.num_cached += 1
            s.output_ids.append(9)


@pytest.mark.task("L10.6")
def test_a_follower_rebuilds_every_table_from_the_entries_it_lacks():
    a = Sequence(list(range(10)), 4, seq_id=1, blocks=[7, 3, 9])
    b = Sequence(list(range(5)), 4, seq_id=2, blocks=[4, 5])
    a.num_cached, b.num_cached = 9, 4
    ranks = TwoRanks()
    assert ranks.step([a, b]) == [0, 0], "a table the followers never saw is sent whole (start 0)"
    ranks.advance([a, b])
    assert ranks.step([a, b]) == [3, 2], "the same table lists, not grown: nothing sent (start = entries sent so far)"
    ranks.advance([a, b])
    assert ranks.step([a, b]) == [3, 2], "the same table lists, not grown: nothing sent"
    ranks.advance([a, b])
    a.blocks.append(11)  # a's 13th token opens a fourth block: appended in place, as every lesson does
    b.blocks = [6, 8]  # any other change is a new list (b preempted and admitted again, say)
    assert ranks.step([a, b]) == [3, 0], "a table grown by one entry sends that entry (start 3); a new list, all"
    ranks.advance([a])
    assert ranks.step([a]) == [4], "b does not run in this step"
    ranks.advance([a, b])
    b.blocks.append(10)
    assert ranks.step([a, b]) == [4, 0], "a request the last step did not run is sent whole: neither side kept it"


@pytest.mark.task("L10.6")
def test_a_follower_copy_that_drifted_is_one_runfailure():
    a = Sequence(list(range(10)), 4, seq_id=1, blocks=[7, 3, 9])
    a.num_cached = 9
    ranks = TwoRanks()
    ranks.step([a])
    ranks.advance([a])
    ranks.kept.kept[1][0].append(99)  # the follower's copy one entry longer than rank 0's
    with pytest.raises(RunFailure, match="sent from entry 3, but this rank holds 4"):
        ranks.step([a])
    ranks = TwoRanks()
    ranks.step([a])
    ranks.advance([a])
    a.blocks[-1] = 55  # rank 0's list edited in place: the rule every lesson keeps, broken
    with pytest.raises(RunFailure, match="ends with block 9 here and 55 on rank 0"):
        ranks.step([a])


# --- L10.7 and L10.8: rank 0's steps replayed by a follower ---


class RecordingGroup(TpGroup):
    """Rank 0 of a group of one (nothing to send: no one to send to) that keeps each call it leads as the
    (header, payload) wire.py would broadcast."""

    def lead(self, kind, *args):
        self.sent.append(pack(kind, *args))
        return super().lead(kind, *args)


class ScriptedGroup(TpGroup):
    """A follower's group: receive() hands out rank 0's messages, unpacked, then None (stop). A group of one,
    so that the follower's model is the whole model, as rank 0's is, and their pools can be compared."""

    def receive(self):
        return self.script.pop(0) if self.script else None


def rank0_run(tiny_dir: Path, prompt_ids: list[list[int]]) -> tuple[L10Engine, list[tuple]]:
    """An n = 2 fork on a 5-token prompt in blocks of 4 (the children share the partial last block: one
    copy-on-write) beside a 30-token prompt in slices of a 16-token budget. Returns the engine and every
    message it led, unpacked as a follower gets it."""
    group = RecordingGroup(0, 1, CPU)
    group.sent = []
    model = TpQwen3ForCausalLM.load(tiny_dir, torch.float32, group)
    engine = L10Engine(model, 4, 32, 8, "torch", graphs=False, max_batched_tokens=16)
    stop = StopRule(6, frozenset(model.config.eos_token_ids), ignore_eos=True)
    assert len(prompt_ids[0]) % 4
    engine.add_parallel(prompt_ids[0], stop, SamplingParams(0.8, top_k=50, seed=5), n=2)
    engine.add_request(prompt_ids[3][:30], stop)
    while engine.scheduler.has_work():
        engine.step()
    assert engine.stats.cow_copies == 1
    return engine, [unpack(header, payload) for header, payload in group.sent]


def check_same_pool(follower: TpRunner, engine: L10Engine, who: str) -> None:
    for name in ("k", "v"):
        for layer, (mine, rank0) in enumerate(zip(getattr(follower.pool, name), getattr(engine.runner.pool, name))):
            differ = [b for b in range(rank0.shape[0]) if not torch.equal(mine[b], rank0[b])]
            assert not differ, (f"{who}: after rank 0's steps, layer {layer}'s {name.upper()} differs from rank 0's "
                                f"in blocks {differ}")


@pytest.mark.task("L10.7")
def test_a_followers_runner_replays_rank_0s_steps_into_the_same_pool(tiny_dir, prompt_ids):
    engine, messages = rank0_run(tiny_dir, prompt_ids)
    steps = [m for m in messages if m[0] == "run_step"]
    assert len(steps) == len(engine.step_tokens), "rank 0 sends each step before it runs it, once"
    copies = [c for m in steps for c in m[2]]
    assert len(copies) == engine.stats.cow_copies, f"the deferred copy-on-write copies sent: {copies}"
    assert [m[0] for m in messages[:2]] == ["load", "build_runner"], [m[0] for m in messages]
    _, block_size, num_blocks, backend, *_ = messages[1]
    runner = TpRunner(TpQwen3ForCausalLM.load(tiny_dir, torch.float32, TpGroup(0, 1, CPU)), block_size, num_blocks,
                      backend)
    for kind, *args in messages[2:]:
        if kind == "capture":
            runner.capture(*args)
        else:
            runner.follow_step(*args)
    check_same_pool(runner, engine, "a follower's runner given each step's slices and copies")


@pytest.mark.task("L10.8")
def test_follow_makes_each_call_rank_0_sends_until_stop(tiny_dir, prompt_ids, monkeypatch):
    engine, messages = rank0_run(tiny_dir, prompt_ids)
    runners = []
    follow_step = TpRunner.follow_step

    def watched(self, *args):
        runners.append(self)
        return follow_step(self, *args)

    monkeypatch.setattr(TpRunner, "follow_step", watched)
    group = ScriptedGroup(0, 1, CPU)
    group.script = list(messages)
    follow(group)
    assert group.script == [], "follow returns only at the stop message (receive() gives None)"
    steps = sum(m[0] == "run_step" for m in messages)
    assert len(runners) == steps, f"{steps} steps sent, {len(runners)} run by the follower"
    assert len({id(r) for r in runners}) == 1, "the follower builds its runner once, then runs every step on it"
    runner = runners[0]
    assert type(runner) is TpRunner and runner.model.config == engine.model.config, (
        "the follower builds the runner class it is sent, over the model it loaded")
    check_same_pool(runner, engine, "follow")

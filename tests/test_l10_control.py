"""L10's control channel and collectives, against a stand-in for torch.distributed: no rank is started here.

- A step travels as int64 tensors (wire.py), never pickled: with pickle's loaders poisoned, rank 0's send
  and a follower's receive round-trip every kind of message; a malformed message is one RunFailure line.
- Every collective is issued with async_op=True and waited for with the step timeout (Work.wait(timeout)),
  the path that bounds NCCL's asynchronous collectives as well as gloo's; rank 0's sends while the ranks
  start wait up to the startup timeout; a follower's wait for the next step is the one unbounded wait.
- close() while the engine thread is inside a step waits for that step: never two collectives at once; a
  step that outlasts the timeout is left alone (the followers are ended) and the group refuses later calls.
- After a failed collective rank 0 sends nothing more (a timed-out send may still arrive, and a follower
  would read the next message as its rest): later calls repeat the first failure; close() sends no stop.
"""
from __future__ import annotations

import math
import pickle
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lessons.l4_continuous.sequence import Sequence
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l10_tensor_parallel.group import TpGroup
from lessons.l10_tensor_parallel.runner import TpRunner
from lessons.l10_tensor_parallel.tables import SentTables
from shared.errors import RunFailure

CPU = torch.device("cpu")
UNBOUNDED = "no timeout"


class FakeDist:
    """torch.distributed's collectives as group.py calls them. Records how each is issued (async or not, the
    timeout its wait was given), counts two at once, and carries rank 0's broadcasts to a follower."""

    def __init__(self, hold_s: float = 0.0):
        self.hold_s = hold_s  # how long each collective takes
        self.issued: list[dict] = []  # {"name", "async_op", "wait"} in issue order
        self.sent: list[torch.Tensor] = []  # what rank 0 broadcast
        self.incoming: list[torch.Tensor] = []  # what a follower's broadcasts receive, in order
        self.follower = False
        self.inside, self.overlaps = 0, 0
        self.entered = {name: threading.Event() for name in ("all_reduce", "broadcast")}
        self._lock = threading.Lock()

    def install(self, monkeypatch) -> "FakeDist":
        for name in ("all_reduce", "gather", "broadcast"):
            monkeypatch.setattr(dist, name, getattr(self, name))
        monkeypatch.setattr(dist, "broadcast_object_list", self.broadcast_object_list)
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        return self

    def _run(self, name: str, async_op: bool, work) -> "FakeWork | None":
        record = {"name": name, "async_op": async_op, "wait": None}
        self.issued.append(record)
        with self._lock:
            self.inside += 1
            self.overlaps += self.inside > 1
        if name in self.entered:
            self.entered[name].set()
        time.sleep(self.hold_s)
        work()
        with self._lock:
            self.inside -= 1
        return FakeWork(record) if async_op else None

    def all_reduce(self, x, group=None, async_op=False):
        return self._run("all_reduce", async_op, lambda: x.mul_(2))  # two ranks holding the same x

    def gather(self, x, parts=None, dst=0, group=None, async_op=False):
        def work():
            for p in parts or []:
                p.copy_(x)
        return self._run("gather", async_op, work)

    def broadcast(self, x, src=0, group=None, async_op=False):
        def work():
            if self.follower:
                x.copy_(self.incoming.pop(0))
            else:
                self.sent.append(x.clone())
        return self._run("broadcast", async_op, work)

    def broadcast_object_list(self, objects, src=0, group=None, async_op=False):
        return self._run("broadcast_object_list", async_op, lambda: None)  # a pickle: the tests below refuse it


class FakeWork:
    def __init__(self, record: dict):
        self.record = record

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.record["wait"] = UNBOUNDED if timeout is None else timeout
        return True


@pytest.fixture
def no_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle on the control channel")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(dist.distributed_c10d, "_unpickler", refuse, raising=False)


def a_step() -> tuple[list[Slice], list[tuple[int, int]]]:
    seq = Sequence(list(range(300, 340)), 16, seq_id=1, blocks=[7, 3, 9])
    seq.num_cached = 32
    other = Sequence([5, 6, 7], 16, seq_id=2, blocks=[4])
    return [Slice.of(seq, 8), Slice.of(other, 2)], [(3, 11), (4, 12)]


def limits():
    """What a follower knows by the first step: its pool (build_runner) and the engine's limits ("limits")."""
    from lessons.l10_tensor_parallel import wire

    return wire.Limits(num_blocks=257, max_running=8, max_step_tokens=64)


def deliver(sender: FakeDist, monkeypatch) -> tuple:
    """What a follower's receive() makes of everything rank 0 broadcast."""
    follower = FakeDist().install(monkeypatch)
    follower.follower, follower.incoming = True, list(sender.sent)
    got = TpGroup(1, 2, CPU, 5.0, compute="compute", control="control", limits=limits()).receive()
    assert follower.incoming == [], "the follower read exactly what was sent"
    assert {r["name"] for r in follower.issued} == {"broadcast"}
    return got


@pytest.mark.task("L10.5")
def test_every_kind_of_message_round_trips_as_int64_tensors_without_pickle(monkeypatch, no_pickle):
    slices, copies = a_step()
    messages = [("load", "/models/tiny qwen3 ✓", "float32"),
                ("build_runner", 16, 257, "torch", "lessons.l10_tensor_parallel.runner:TpRunner"),
                ("build_runner", 16, 257, "torch", "lessons.l12_kv_quant.runner:requantized", "int8",
                 "lessons.l10_tensor_parallel.runner:TpRunner"),
                ("capture", [1, 2, 4], 256), ("run_step", slices, copies)]
    for kind, *args in messages:
        sender = FakeDist().install(monkeypatch)
        with TpGroup(0, 2, CPU, 5.0, compute="compute", control="control").lead(kind, *args):
            pass
        assert {r["name"] for r in sender.issued} == {"broadcast"}, f"{kind}: {sender.issued}"
        assert sender.sent and all(t.dtype == torch.int64 for t in sender.sent)
        got = deliver(sender, monkeypatch)
        if kind != "run_step":
            assert got == (kind, *args)
            continue
        assert got[0] == "run_step" and got[2] == copies
        for want, s in zip(slices, got[1], strict=True):
            assert (s.block_size, s.blocks, s.num_cached, s.num_tokens, s.decode, s.samples) == \
                   (want.block_size, want.blocks, want.num_cached, want.num_tokens, want.decode, want.samples)
            assert s.token_ids(s.num_cached, s.num_tokens) == want.token_ids(want.num_cached, want.num_tokens)
    sender = FakeDist().install(monkeypatch)
    TpGroup(0, 2, CPU, 5.0, compute="compute", control="control").close()  # the stop message
    assert deliver(sender, monkeypatch) is None


def bad_messages() -> dict[str, list[torch.Tensor]]:
    """What a follower's broadcasts receive: a header, then (when it says so) a payload."""
    from lessons.l10_tensor_parallel import wire

    def message(kind: int, *payload: int) -> list[torch.Tensor]:
        return [torch.tensor([wire.MAGIC, kind, len(payload)]), torch.tensor(payload, dtype=torch.int64)]

    load, capture, run_step = (wire.KINDS.index(k) for k in ("load", "capture", "run_step"))
    return {
        "bad magic": [torch.tensor([7, load, 0])],
        "unknown kind": [torch.tensor([wire.MAGIC, 99, 0])],
        "payload length": [torch.tensor([wire.MAGIC, load, 1 << 62])],
        "overruns": message(load, 1, 65, 7, 66),  # a 1-byte string, then 7 bytes promised and 1 there
        "not UTF-8": message(load, 1, 255, 1, 65),
        "fields, not 2": message(load, 1, 65),
        "run_step": message(run_step, 0, 1, 5),  # copies, then a third of a slice
        "below 1": message(capture, 1, -2, 1, 0),  # a capture size of -2
        # A negative kind would index KINDS from the end: -6 would read as "stop", a follower told to quit.
        "unknown kind -6": [torch.tensor([wire.MAGIC, -len(wire.KINDS), 0])],
        "unknown kind -9223372036854775808": [torch.tensor([wire.MAGIC, -(1 << 63), 0])],
        "payload length -1 ": [torch.tensor([wire.MAGIC, load, -1])],  # torch.zeros(-1) would raise
        "a field of length -3": message(load, -3, 65, 1, 65),
        "none of float32": message(load, 1, 65, 3, *b"f99"),  # a dtype DTYPES lacks: a KeyError in the follower
        "no slice": message(run_step, 0),  # copies, then no slice: no step rank 0 would send
    }


MALFORMED = ["bad magic", "unknown kind", "payload length", "overruns", "not UTF-8", "fields, not 2", "run_step",
             "below 1", "unknown kind -6", "unknown kind -9223372036854775808", "payload length -1 ",
             "a field of length -3", "none of float32", "no slice"]


@pytest.mark.parametrize("what", MALFORMED)
def test_a_malformed_message_is_one_runfailure_line(monkeypatch, no_pickle, what):
    follower = FakeDist().install(monkeypatch)
    follower.follower, follower.incoming = True, bad_messages()[what]
    with pytest.raises(RunFailure) as e:
        TpGroup(1, 2, CPU, 5.0, compute="compute", control="control", limits=limits()).receive()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("tensor-parallel rank 1 of 2: malformed control message from rank 0")
    assert what in msg


@pytest.mark.task("L10.5")
def test_a_header_or_payload_pack_did_not_write_is_malformed_before_any_allocation():
    """wire.py alone: a header of the wrong shape or dtype, a kind or length out of range, a payload that is not
    what its header says (shorter, longer, not int64). Each is Malformed naming it; nothing is sized from it."""
    from lessons.l10_tensor_parallel import wire

    load = wire.KINDS.index("load")
    headers = {
        "a header must be 3 int64s": [torch.tensor([wire.MAGIC, load]), torch.tensor([wire.MAGIC, load, 0, 0]),
                                      torch.tensor([float(wire.MAGIC), load, 0]),
                                      torch.tensor([wire.MAGIC, load, 0], dtype=torch.int32),
                                      torch.tensor([[wire.MAGIC, load, 0]])],
        "unknown kind": [torch.tensor([wire.MAGIC, k, 0]) for k in (-1, -len(wire.KINDS), len(wire.KINDS))],
        "payload length": [torch.tensor([wire.MAGIC, load, n]) for n in (-1, -(1 << 63))],
    }
    for says, bad in headers.items():
        for header in bad:
            with pytest.raises(wire.Malformed, match=says):
                wire.payload_len(header)
            with pytest.raises(wire.Malformed, match=says):
                wire.unpack(header, torch.zeros(0, dtype=torch.int64))
    longest = wire.Limits().most("load")  # a follower's bound, known before any message: two strings of PATH_MAX
    with pytest.raises(wire.Malformed, match=f"payload length {longest + 1} outside 0..{longest}"):
        wire.payload_len(torch.tensor([wire.MAGIC, load, longest + 1]), wire.Limits())
    header, payload = wire.pack("load", "/m", "float32")
    assert wire.unpack(header, payload) == ("load", "/m", "float32")
    for wrong in (payload[:-1], torch.cat([payload, payload[:1]]), payload.to(torch.int32), payload[None]):
        with pytest.raises(wire.Malformed, match="the header says"):  # a length past (or short of) what follows
            wire.unpack(header, wrong)


def test_a_header_announcing_more_than_a_step_can_hold_is_refused_before_allocation(monkeypatch, no_pickle):
    """A well-formed run_step header announcing 2 GiB of int64: a follower sizes nothing from it. What it knows
    by the first step (its pool, the engine's token budget), or before any message (nothing), bounds a step far
    below that, and the header is one RunFailure line."""
    from lessons.l10_tensor_parallel import wire

    real_zeros = torch.zeros

    def zeros(*size, **kwargs):
        n = math.prod(size[0] if len(size) == 1 and not isinstance(size[0], int) else size)
        assert n <= 1 << 20, f"a follower allocated {n:,} int64s from a header"
        return real_zeros(*size, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    huge = torch.tensor([wire.MAGIC, wire.KINDS.index("run_step"), 1 << 28])  # 2 GiB of int64
    for by_the_first_step in (False, True):
        follower = FakeDist().install(monkeypatch)
        follower.follower, follower.incoming = True, [huge]
        group = TpGroup(1, 2, CPU, 5.0, compute="compute", control="control")
        if by_the_first_step:
            group.limits = limits()
        with pytest.raises(RunFailure) as e:
            group.receive()
        known = group.limits
        most = known.most("run_step")
        assert most < 20_000 and str(e.value) == (
            f"tensor-parallel rank 1 of 2: malformed control message from rank 0 (payload length {1 << 28} outside "
            f"0..{most} (the most a run_step message holds under {known}))")


def test_a_follower_learns_its_bound_from_the_messages_and_the_largest_step_fits_it(monkeypatch, no_pickle):
    """Rank 0's engine sends its limits once, before the capture and any step; a follower keeps them beside its
    pool's size from build_runner. The largest step they allow (a slice per token of the budget, each with a
    table of every block, a copy into every block) is exactly the bound; one int64 more is refused."""
    from lessons.l10_tensor_parallel import wire

    blocks, running, budget = 9, 3, 4
    sender = FakeDist().install(monkeypatch)
    rank0 = TpGroup(0, 2, CPU, 5.0, compute="compute", control="control")
    slices = [Slice.of(Sequence([7], 2, seq_id=i, blocks=list(range(blocks))), 1) for i in range(budget)]
    with rank0.lead("build_runner", 2, blocks, "torch", *TpRunner.recipe()):
        pass
    rank0.send_limits(running, budget)
    for kind, *args in [("capture", list(range(1, running + 1)), blocks - 1),
                        ("run_step", slices, [(i, (i + 1) % blocks) for i in range(blocks)])]:
        with rank0.lead(kind, *args):
            pass
    known = wire.Limits(num_blocks=blocks, max_running=running, max_step_tokens=budget)
    assert [int(h[2]) for h in sender.sent[-4::2]] == [known.most("capture"), known.most("run_step")]
    follower = FakeDist().install(monkeypatch)
    follower.follower, follower.incoming = True, list(sender.sent)
    rank1 = TpGroup(1, 2, CPU, 5.0, compute="compute", control="control")
    assert rank1.receive()[:3] == ("build_runner", 2, blocks)
    assert rank1.receive() == ("capture", [1, 2, 3], blocks - 1)  # "limits" is the wire's own: no call to make
    assert rank1.limits == known
    kind, got, _ = rank1.receive()
    assert kind == "run_step" and [s.seq_id for s in got] == list(range(budget))
    follower.incoming = [torch.tensor([wire.MAGIC, wire.KINDS.index("run_step"), known.most("run_step") + 1])]
    with pytest.raises(RunFailure, match=f"payload length {known.most('run_step') + 1} outside"):
        rank1.receive()


@pytest.mark.task("L10.8")
def test_a_follower_builds_the_runner_class_it_is_sent_and_nothing_else():
    """build_runner names the class (TpRunner.recipe), or a runner_factory and its strings; the follower imports
    only a name defined in a module under lessons. and refuses anything else in one RunFailure line."""
    from lessons.l10_tensor_parallel.follower import runner_class

    assert TpRunner.recipe() == ["lessons.l10_tensor_parallel.runner:TpRunner"]
    assert runner_class(*TpRunner.recipe()) is TpRunner
    refused = {
        "os:system": "under lessons.",  # outside the course
        "lessons.l10_tensor_parallel.runner:_private": "under lessons.",
        "lessons.l10_tensor_parallel.runner:TpRunner.recipe": "under lessons.",  # no attribute walks
        "lessons.no_such_lesson:Runner": "No module named",
        "lessons.l10_tensor_parallel.follower:importlib": "defines no importlib",  # imported into it, not defined
        "lessons.l10_tensor_parallel.wire:Malformed": "not a TpRunner class",
    }
    for path, says in refused.items():
        with pytest.raises(RunFailure, match=says):
            runner_class(path)
    with pytest.raises(RunFailure, match="not a runner_factory"):  # a function is called only when marked
        runner_class("lessons.l10_tensor_parallel.wire:pack", "stop")


def test_collectives_are_async_and_waited_for_with_the_step_timeout(monkeypatch):
    fake = FakeDist().install(monkeypatch)
    group = TpGroup(0, 2, CPU, 7.0, compute="compute", control="control")
    bounded = timedelta(seconds=7)
    assert group.all_reduce(torch.ones(3)).tolist() == [2, 2, 2]
    assert group.gather_last_dim(torch.ones(2, 3)).shape == (2, 6)
    assert [(r["name"], r["async_op"], r["wait"]) for r in fake.issued] == \
           [("all_reduce", True, bounded), ("gather", True, bounded)]
    with group.lead("run_step", *a_step()):  # rank 0's send of a step: a header, then a payload
        pass
    assert [(r["name"], r["async_op"], r["wait"]) for r in fake.issued[2:]] == [("broadcast", True, bounded)] * 2
    # The calls made while the ranks start wait longer: a follower still loading its part has not hung.
    del fake.issued[:], fake.sent[:]
    with group.lead("capture", [1, 2], 5):
        pass
    from lessons.l10_tensor_parallel.group import STARTUP_TIMEOUT_S  # (new with the fix: imported here)

    startup = timedelta(seconds=STARTUP_TIMEOUT_S)
    assert [(r["name"], r["async_op"], r["wait"]) for r in fake.issued] == [("broadcast", True, startup)] * 2
    # A follower: its step's collectives bounded the same way; its wait for the next step is not.
    follower = FakeDist().install(monkeypatch)
    follower.follower, follower.incoming = True, list(fake.sent)
    rank1 = TpGroup(1, 2, CPU, 7.0, compute="compute", control="control", limits=limits())
    assert rank1.receive() == ("capture", [1, 2], 5)
    rank1.all_reduce(torch.ones(3))
    assert [(r["name"], r["async_op"], r["wait"]) for r in follower.issued] == \
           [("broadcast", True, UNBOUNDED)] * 2 + [("all_reduce", True, bounded)]


def stepping_runner(group: TpGroup) -> TpRunner:
    """TpRunner.forward as the engine thread calls it, with a step that is one all-reduce."""
    runner = TpRunner.__new__(TpRunner)
    runner.tp, runner.allocator, runner.sent_tables = group, SimpleNamespace(take_copies=list), SentTables()
    runner.run_step = lambda slices, copies: group.all_reduce(torch.ones(2))
    return runner


def test_close_waits_for_the_step_in_flight_never_two_collectives_at_once(monkeypatch):
    fake = FakeDist(hold_s=0.3).install(monkeypatch)
    group = TpGroup(0, 2, CPU, 30.0, compute="compute", control="control")
    stepping = threading.Thread(target=stepping_runner(group).forward, args=([],))
    stepping.start()
    assert fake.entered["all_reduce"].wait(30)
    group.close()  # the server shutting down while the engine thread is inside the step
    stepping.join(30)
    assert fake.overlaps == 0, fake.issued
    names = [r["name"] for r in fake.issued]
    assert names[names.index("all_reduce") + 1:] == ["broadcast"], names  # the stop message, after the step


def test_close_leaves_a_step_that_outlasts_the_timeout_alone(monkeypatch):
    fake = FakeDist(hold_s=2.0).install(monkeypatch)
    group = TpGroup(0, 2, CPU, 0.2, compute="compute", control="control")
    ended = []
    group.on_close.append(lambda: ended.append("followers"))
    stepping = threading.Thread(target=stepping_runner(group).forward, args=([],))
    stepping.start()
    assert fake.entered["all_reduce"].wait(30)
    group.close()
    assert ended == ["followers"] and fake.overlaps == 0
    stepping.join(30)
    assert [r["name"] for r in fake.issued][-1] == "all_reduce", "no stop message beside the step"
    with pytest.raises(RunFailure, match="after the group was closed"):
        stepping_runner(group).forward([])


def test_after_a_failed_collective_rank_0_sends_nothing_more(monkeypatch):
    """A send that timed out may still arrive: a follower would read the next message (even the stop) as the
    rest of it. So after any failed collective rank 0 sends nothing: later calls fail with the first failure,
    and close() ends the followers without a stop message."""
    fake = FakeDist().install(monkeypatch)

    def lost(x, group=None, async_op=False):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")

    monkeypatch.setattr(dist, "all_reduce", lost)
    group = TpGroup(0, 2, CPU, 5.0, compute="compute", control="control")
    ended = []
    group.on_close.append(lambda: ended.append("followers"))
    with pytest.raises(RunFailure) as first:
        stepping_runner(group).forward([])
    assert str(first.value) == ("tensor-parallel rank 0 of 2: all-reduce failed (Connection closed by peer "
                                "[127.0.0.1]:1234); another rank exited or hung longer than the 5 s timeout")
    issued = len(fake.issued)  # the step's send, before its all-reduce failed
    with pytest.raises(RunFailure) as again:
        stepping_runner(group).forward([])
    assert str(again.value) == str(first.value)
    group.close()
    assert len(fake.issued) == issued and ended == ["followers"], "no message after the failure"

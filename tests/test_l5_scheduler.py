"""L5's preempting scheduler on the fake runner: random workloads in pools small enough to preempt often.

On top of L4's invariants: a swapped-out request owns its host blocks exactly once, host free + owned =
host total, and no request ever holds device and host blocks at the same time.
"""
import random

import pytest

from fake_runner import FakeRunner, fake_model, reference
from lessons.l4_continuous.sequence import Sequence, Status
from lessons.l5_preemption import L5Engine
from shared.errors import CourseError
from shared.generation import StopRule
from test_l4_scheduler import check_pool, drive, expected, random_workload


def check_pool_and_host(engine) -> None:
    check_pool(engine)
    sched = engine.scheduler
    if sched.host is None:
        assert not sched.swapped
        return
    owners: dict[int, int] = {}
    for seq in sched.swapped:
        assert seq.status is Status.SWAPPED and seq.blocks == []
        for b in seq.extra["host_blocks"]:
            assert b not in owners, f"host block {b} owned twice"
            owners[b] = seq.seq_id
    for seq in list(sched.running) + list(sched.waiting):
        assert "host_blocks" not in seq.extra, "a request holds host blocks outside the swapped queue"
    host = sched.host.allocator
    assert host.num_free + len(owners) == host.num_blocks


def check_arrival_order(engine) -> None:
    """Running is sorted by arrival and arrived before every queued request (so the victim is its last)."""
    check_pool_and_host(engine)
    sched = engine.scheduler
    running = [s.seq_id for s in sched.running]
    queued = [s.seq_id for s in list(sched.waiting) + list(sched.swapped)]
    assert running == sorted(running), f"running {running}: requests run in arrival (seq_id) order"
    assert not running or not queued or max(running) < min(queued), (
        f"running {running}, queued {queued}: every running request arrived before every queued one, so the victim "
        f"is always the newest running request (the last of `running`), never an older one")


@pytest.mark.task("L5.4")
@pytest.mark.parametrize("policy", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_under_pressure(policy, seed):
    rng = random.Random(100 + seed)
    block_size, num_blocks = rng.choice([1, 2, 4]), rng.randint(8, 16)
    host_blocks = rng.choice([None, 2, 6])  # a small host pool forces the fall-back to recompute
    engine = L5Engine(fake_model(), block_size, num_blocks, max_running=rng.randint(2, 8),
                      runner=FakeRunner(block_size, num_blocks), policy=policy, host_blocks=host_blocks)
    cap = num_blocks * block_size
    workload = random_workload(rng, 20, max_prompt=max(1, cap // 3), max_new=max(1, cap // 2), span=20)
    seqs = drive(engine, workload, check_arrival_order)
    for seq, a in zip(seqs, workload):
        assert seq.status is Status.FINISHED and seq.output_ids == expected(a)
    assert engine.allocator.num_free == num_blocks
    if engine.scheduler.host is not None:
        assert engine.scheduler.host.allocator.num_free == engine.scheduler.host.allocator.num_blocks


@pytest.mark.task("L5.4")
@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_the_running_request_that_arrived_last_is_preempted(policy):
    engine = L5Engine(fake_model(), 2, 4, runner=FakeRunner(2, 4), policy=policy)
    old = engine.add_request([1, 2, 3], StopRule(6))  # prompt: 2 blocks; grows to 4
    engine.step()
    new = engine.add_request([4], StopRule(6))  # 1 block: fits now; at its 3rd token the pool is dry
    engine.step()
    assert engine.scheduler.running == [old, new]
    while engine.stats.preemptions == 0:
        engine.step()
    assert old.status is Status.RUNNING
    assert new.status is (Status.SWAPPED if policy == "swap" else Status.WAITING)
    while engine.scheduler.has_work():
        engine.step()
    assert old.output_ids == reference([1, 2, 3], 6) and new.output_ids == reference([4], 6)


@pytest.mark.task("L5.4")
def test_a_lone_request_that_cannot_grow_is_an_error_not_a_hang():
    engine = L5Engine(fake_model(), 2, 2, runner=FakeRunner(2, 2))
    seq = Sequence([1, 2, 3], 2, stop=StopRule(4))  # needs 3 blocks; smuggled past add()'s size check
    engine.scheduler.waiting.append(seq)
    engine.step()  # its 3-token prompt fits in 2 blocks
    with pytest.raises(CourseError, match="alone"):
        for _ in range(5):
            engine.step()


def test_unknown_policy():
    with pytest.raises(CourseError, match="policy"):
        L5Engine(fake_model(), 2, 4, runner=FakeRunner(2, 4), policy="lru")


@pytest.mark.task("L5.4")
def test_the_victim_is_the_newest_running_request_not_the_next_in_line():
    """A (admitted first) needs a block; B and C do not. The newest, C, must give its block, not B."""
    engine = L5Engine(fake_model(), 4, 3, runner=FakeRunner(4, 3))
    a = engine.add_request([1, 2, 3, 4], StopRule(6))  # 1 full block; its 5th token needs a 2nd
    b = engine.add_request([5], StopRule(6))
    c = engine.add_request([6], StopRule(6))
    engine.step()  # all three admitted, in order: the pool is full
    engine.step()
    assert engine.stats.preemptions == 1, (
        f"A's 5th token needs a 2nd block in a full pool: one preemption, got {engine.stats.preemptions}")
    running = [s.seq_id for s in engine.scheduler.running]
    assert running == [a.seq_id, b.seq_id] and c.status is Status.WAITING, (
        f"A needs a block, B and C do not: the victim is C ({c.seq_id}), the newest running request, not B "
        f"({b.seq_id}), the next in line after A; running {running}, C is {c.status.name}")
    while engine.scheduler.has_work():
        engine.step()
    assert [s.output_ids for s in (a, b, c)] == [reference([1, 2, 3, 4], 6), reference([5], 6), reference([6], 6)]


@pytest.mark.task("L5.4")
def test_a_small_host_pool_does_not_let_a_younger_swapped_request_starve_an_older_one():
    """host_blocks=1: the first victim falls back to recompute (waiting), a later one is swapped. The old
    rule served `swapped` first, so the younger request overtook the older one, which was then the newest
    running request and was preempted again and again. Arrival order must hold across both queues."""
    engine = L5Engine(fake_model(), 1, 8, runner=FakeRunner(1, 8), policy="swap", host_blocks=1)
    prompts = [[1, 2], [3], [4], [5]]
    seqs = [engine.add_request(p, StopRule(6)) for p in prompts]
    admissions: list[int] = []
    preempted_at: dict[int, int] = {s.seq_id: 0 for s in seqs}
    while engine.scheduler.has_work():
        before = {s.seq_id for s in engine.scheduler.running}
        engine.step()
        check_arrival_order(engine)
        admissions += [s.seq_id for s in engine.scheduler.running if s.seq_id not in before]
        for s in seqs:
            preempted_at[s.seq_id] += s.seq_id in before and s.status in (Status.WAITING, Status.SWAPPED)
    assert (engine.stats.preemptions, engine.stats.swaps_out) == (5, 1)  # both queues were used
    # Every readmission takes the oldest queued request (the old rule went 0 1 2 3 3 3 1 1 2 2).
    assert admissions == [0, 1, 2, 3, 1, 2, 2, 3, 3]
    assert preempted_at == {0: 0, 1: 1, 2: 2, 3: 2}  # the old rule preempted 1 twice, for 3's sake
    assert [s.finished_at for s in seqs] == [6, 9, 12, 15]  # in arrival order (old: 3 finished before 1)
    assert all(s.output_ids == reference(p, 6) for s, p in zip(seqs, prompts))


@pytest.mark.task("L5.4")
def test_exact_queues_after_each_preemption():
    """Same workload as above: each victim is the last running request, and goes to the front of its queue."""
    engine = L5Engine(fake_model(), 1, 8, runner=FakeRunner(1, 8), policy="swap", host_blocks=1)
    for prompt in [[1, 2], [3], [4], [5]]:
        engine.add_request(prompt, StopRule(6))
    queues = []  # (running, waiting, swapped) seq_ids after each of the first 10 steps
    for _ in range(10):
        engine.step()
        sched = engine.scheduler
        queues.append(tuple([s.seq_id for s in q] for q in (sched.running, sched.waiting, sched.swapped)))
    assert queues == [
        ([0, 1, 2, 3], [], []),
        ([0, 1, 2], [], [3]),  # 3 swapped out into the one host block
        ([0, 1], [2], [3]),  # host full: 2 falls back to recompute
        ([0], [1, 2], [3]),
        ([0], [1, 2], [3]),
        ([], [1, 2], [3]),  # 0 finished
        ([1, 2], [], [3]),  # 1 and 2 arrived before 3: they go first although 3 is swapped
        ([1], [2], [3]),
        ([], [2], [3]),
        ([2, 3], [], []),  # 2, then 3 swapped back in
    ]

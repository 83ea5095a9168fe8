"""Scheduler invariants under seeded random workloads, on a model-free fake runner (tests/fake_runner.py).

After every step: each block is free or owned by exactly one running request; free + owned = total;
waiting requests hold no blocks; each running request holds the blocks for every token it was fed.
At the end: every request finished, with the tokens a correct engine emits, and the pool is whole.
"""
import random

import pytest

from fake_runner import FakeRunner, fake_model, reference
from lessons.l2_token_flat.engine import blocks_for
from lessons.l4_continuous.engine import Arrival, L4Engine
from lessons.l4_continuous.sequence import Status
from shared.errors import CourseError
from shared.generation import StopRule


def check_pool(engine) -> None:
    sched, alloc = engine.scheduler, engine.allocator
    owners: dict[int, int] = {}
    for seq in sched.running:
        assert seq.status is Status.RUNNING
        for b in seq.blocks:
            assert b not in owners, f"block {b} owned by {owners[b]} and {seq.seq_id}"
            owners[b] = seq.seq_id
        assert len(seq.blocks) >= blocks_for(seq.num_cached, engine.block_size)
    for seq in list(sched.waiting) + list(getattr(sched, "swapped", [])):
        assert seq.blocks == [], f"queued request {seq.seq_id} holds blocks"
    free = set(alloc._free)
    assert len(free) == alloc.num_free, "a block is on the free list twice"
    assert not free & set(owners), "a block is both free and owned"
    assert alloc.num_free + len(owners) == alloc.num_blocks, "a block is neither free nor owned: leaked"


def random_workload(rng: random.Random, n: int, max_prompt: int, max_new: int, span: int) -> list[Arrival]:
    return [Arrival([rng.randrange(64) for _ in range(rng.randint(1, max_prompt))],
                    StopRule(rng.randint(1, max_new), frozenset({rng.randrange(64)}), ignore_eos=rng.random() < 0.5),
                    step=rng.randint(0, span)) for _ in range(n)]


def drive(engine, workload: list[Arrival], check=check_pool) -> list:
    """engine.run, unrolled so the invariants are checked after every step."""
    seqs, k = {}, 0
    order = sorted(range(len(workload)), key=lambda i: workload[i].step)
    for _ in range(10_000):
        while k < len(order) and workload[order[k]].step <= engine.clock:
            a = workload[order[k]]
            seqs[order[k]] = engine.add_request(a.prompt_ids, a.stop, a.sampling)
            k += 1
        if k == len(order) and not engine.scheduler.has_work():
            break
        for seq in engine.scheduler.running:
            assert seq.blocks, "a running request without blocks"
        engine.step()
        check(engine)
    else:
        raise AssertionError("the engine did not finish: a hang")
    return [seqs[i] for i in range(len(workload))]


def expected(a: Arrival) -> list[int]:
    out = reference(a.prompt_ids, a.stop.max_new_tokens)
    for i, t in enumerate(out):  # cut at the first stop token, as the engine must
        if a.stop.is_done(out[: i + 1]):
            return out[: i + 1]
    return out


@pytest.mark.task("L4.7")
@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_the_pool_consistent_and_finish(seed):
    rng = random.Random(seed)
    block_size, num_blocks = rng.choice([1, 2, 4, 7]), rng.randint(12, 40)
    cap = num_blocks * block_size // 2  # keep each request within the pool
    engine = L4Engine(fake_model(), block_size, num_blocks, max_running=rng.randint(1, 6),
                      runner=FakeRunner(block_size, num_blocks))
    workload = random_workload(rng, 25, max_prompt=min(20, cap), max_new=max(1, min(15, cap - 20)), span=40)
    seqs = drive(engine, workload)
    for seq, a in zip(seqs, workload):
        assert seq.status is Status.FINISHED and seq.blocks == []
        assert seq.output_ids == expected(a)
    assert engine.allocator.num_free == num_blocks
    assert engine.stats.peak_running <= engine.scheduler.max_running


@pytest.mark.task("L4.7")
def test_admission_is_fifo_and_waits_for_blocks():
    """Backpressure: a request that does not fit waits, in order, and runs once blocks come back."""
    engine = L4Engine(fake_model(), 4, 6, runner=FakeRunner(4, 6))
    a = engine.add_request(list(range(9)), StopRule(8))  # needs ceil(16/4) = 4 blocks, promised
    b = engine.add_request(list(range(5)), StopRule(4))  # needs 2: fits beside a
    c = engine.add_request([1], StopRule(2))  # needs 1: does not fit until someone leaves
    engine.step()
    assert engine.scheduler.running == [a, b] and list(engine.scheduler.waiting) == [c]
    while b.status is not Status.FINISHED:
        engine.step()
    engine.step()
    assert c.status is not Status.WAITING  # admitted as soon as b's blocks came back


@pytest.mark.task("L4.7")
def test_a_request_larger_than_the_pool_is_rejected_without_a_trace():
    engine = L4Engine(fake_model(), 4, 5, runner=FakeRunner(4, 5))
    ok = engine.add_request([1, 2, 3], StopRule(6))
    engine.step()
    before = (engine.allocator.num_free, list(engine.scheduler.waiting), list(engine.scheduler.running))
    with pytest.raises(CourseError, match="needs 6 blocks"):
        engine.add_request(list(range(20)), StopRule(5))  # 24 tokens fed = 6 blocks > 5
    assert (engine.allocator.num_free, list(engine.scheduler.waiting), list(engine.scheduler.running)) == before
    while engine.scheduler.has_work():
        engine.step()
    assert ok.output_ids == reference([1, 2, 3], 6)


@pytest.mark.task("L4.7")
def test_max_running_limits_the_batch():
    engine = L4Engine(fake_model(), 4, 100, max_running=2, runner=FakeRunner(4, 100))
    for i in range(5):
        engine.add_request([i + 1], StopRule(5))
    engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 3


@pytest.mark.task("L4.7")
def test_kv_utilization_on_a_hand_computed_case():
    """S = 2. A: 3-token prompt, 3 new tokens; B: 1-token prompt, 1 new token; both admitted at step 1.
    Per step (held = tokens whose K/V are written, reserved = allocated blocks x 2):
      step 1: A holds 3 in 2 blocks, B holds 1 in 1 block -> 4 / 6 (B finishes, frees its block)
      step 2: A holds 4 in 2 blocks                        -> 4 / 4
      step 3: A holds 5 in 3 blocks                        -> 5 / 6 (A finishes)
    mean = (4/6 + 4/4 + 5/6) / 3 = 2.5 / 3; the peak (6 slots) is first reached at step 1: 4 / 6."""
    engine = L4Engine(fake_model(), 2, 8, max_running=2, runner=FakeRunner(2, 8))
    engine.add_request([1, 2, 3], StopRule(3))
    engine.add_request([4], StopRule(1))
    while engine.scheduler.has_work():
        engine.step()
    stats = engine.stats
    got = (stats.tokens_held, stats.slots_reserved, stats.running)
    assert got == ([4, 4, 5], [6, 4, 6], [2, 1, 1]), (
        f"per step (tokens held, slots reserved = allocated blocks x S, requests running): {got}; the hand count is "
        "([4, 4, 5], [6, 4, 6], [2, 1, 1])")
    assert stats.utilization_mean == pytest.approx(2.5 / 3), f"mean KV utilization {stats.utilization_mean}, want 2.5 / 3"
    assert stats.utilization_at_peak == pytest.approx(4 / 6), f"utilization at the peak {stats.utilization_at_peak}, want 4 / 6"

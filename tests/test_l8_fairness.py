"""Fair sharing in L8's scheduler, on the fake runner (tests/fake_runner.py), as exact schedules:
  - n > 1 siblings count against max_running: those without a slot queue, so decodes cannot outgrow
    max_running and starve a prompt (before: nine requests ran with max_running 2);
  - a request waiting for a block in flight is passed by unrelated requests behind it, and admitted
    (a hit) once the block is written;
  - max_long_prefills / long_prefill_threshold: short prompts overtake long ones;
  - three and four requests with one long prompt, admitted together: each after the first waits and hits.
"""
import pytest

from fake_runner import fake_model
from lessons.l4_continuous.engine import Arrival
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from shared.errors import CourseError
from shared.generation import StopRule
from test_l4_scheduler import expected
from test_l6_scheduler import solo
from test_l8_scheduler import Counting, CountingL8, check_pool, fake_l8, plans_of


def run_to_end(engine, most_running: list[int] | None = None) -> None:
    for _ in range(1_000):
        if not engine.scheduler.has_work():
            return
        engine.step()
        check_pool(engine)
        if most_running is not None:
            most_running.append(len(engine.scheduler.running))
    raise AssertionError("the engine did not finish: a hang")


def ttft_step(engine, seq) -> int:
    return engine.timing[seq.seq_id].token_steps[0]


def test_siblings_count_against_max_running_and_a_prompt_is_not_starved():
    """max_running 2, budget 8, S = 4. A: 3 tokens, n = 8 samples of 40 tokens; B: 30 tokens; both at
    clock 0. Step 1: A's 3 tokens + B's first 5; A's prefill completes, and with A and B running no slot is
    free: A's 7 siblings queue (ahead of nothing younger: B is already running). Steps 2-4: A's decode + 7
    of B's tokens; step 5: A's decode + B's last 4, B's first token. (Before: the 7 siblings joined at once,
    9 running, 8 decodes took the whole budget until they finished, and B's first token came in step 44.)
    Each sibling, admitted later, hits A's cached block and samples what its seed gives alone."""
    engine = fake_l8(4, 64, max_running=2, max_batched_tokens=8)
    plans = plans_of(engine)
    a = Arrival([1, 2, 3], StopRule(40), SamplingParams(1.0, seed=5))
    group = engine.add_parallel(a.prompt_ids, a.stop, a.sampling, n=8)
    b = engine.add_request(list(range(10, 40)), StopRule(3))
    engine.step()
    assert [s.status for s in group[1:]] == [Status.WAITING] * 7 and not any(s.output_ids for s in group[1:])
    assert [s.seq_id for s in engine.scheduler.waiting] == [s.seq_id for s in group[1:]]
    most = [len(engine.scheduler.running)]
    run_to_end(engine, most)
    assert ttft_step(engine, b) == 5
    assert [(sid, start, end) for sid, start, end, *_ in plans[4]] == [(0, 6, 7), (b.seq_id, 26, 30)]
    assert max(most) == 2
    assert b.output_ids == expected(Arrival(b.prompt_ids, b.stop))
    assert [s.output_ids for s in group] == [solo(a, 5 + i) for i in range(8)]
    # B finishes in step 7: sibling 1 takes its slot in step 8; then each of A and sibling 1 frees a slot as
    # it finishes 40 tokens, and so on: two at a time, each recomputing the 3-token prompt when admitted.
    assert [s.admitted_at for s in group] == [1, 8, 41, 48, 81, 88, 121, 128]
    assert [ttft_step(engine, s) for s in group] == [1, 8, 41, 48, 81, 88, 121, 128]


@pytest.mark.parametrize("wait", [True, False])
def test_a_request_waiting_for_blocks_in_flight_is_passed_by_an_unrelated_one(wait):
    """S = 4, budget 8, slices of at most 4. A: 32 tokens, alone in step 1 (tokens 0..4). Then B (A's 32
    tokens and one more) and C (3 unrelated tokens) arrive. A's later slices fill every block B would hit:
    with wait_for_inflight B waits until A's prompt is complete (its last slice is step 8), and is admitted
    in step 9 with 8 hits (32 cached, 1 computed). C does not wait behind B: it is admitted in step 2 and
    samples there (before: step 9, behind B). Without waiting, B is admitted in step 2 and hits only A's
    first block, and its slices and A's take the whole budget until step 9."""
    engine = fake_l8(4, 64, max_batched_tokens=8, max_slice_tokens=4, wait_for_inflight=wait)
    prompt = list(range(32))
    a = engine.add_request(prompt, StopRule(12))
    engine.step()
    b = engine.add_request(prompt + [40], StopRule(2))
    c = engine.add_request([50, 51, 52], StopRule(2))
    run_to_end(engine)
    assert (b.admitted_at, c.admitted_at) == ((9, 2) if wait else (2, 9))
    assert ttft_step(engine, c) == c.admitted_at
    assert engine.stats.cached_tokens == (32 if wait else 4)
    for seq in (a, b, c):
        assert seq.output_ids == expected(Arrival(seq.prompt_ids, seq.stop))


def test_the_waiting_one_goes_first_once_its_blocks_are_written():
    """max_running 2, S = 4, budget 8, slices of 4: A (16 tokens) runs; B (A's prompt and one more) waits for
    A's blocks; C and D (3 unrelated tokens each) arrive behind B. C passes B and takes the second slot in
    step 2; D has no slot. A's prompt completes in step 4 (4 slices), C finishes in step 3, so in step 4 one
    slot is free but B's blocks are still in flight: D takes it. Once A's blocks are written B is the oldest
    waiting: it gets the next free slot (D finishes in step 5, so B is admitted in step 6) with 4 hits."""
    engine = fake_l8(4, 64, max_running=2, max_batched_tokens=8, max_slice_tokens=4)
    prompt = list(range(16))
    a = engine.add_request(prompt, StopRule(6))
    engine.step()
    b = engine.add_request(prompt + [40], StopRule(2))
    c = engine.add_request([50, 51, 52], StopRule(2))
    d = engine.add_request([60, 61, 62], StopRule(2))
    run_to_end(engine)
    assert [s.admitted_at for s in (a, b, c, d)] == [1, 6, 2, 4]
    assert engine.stats.cached_tokens == 16
    for seq in (a, b, c, d):
        assert seq.output_ids == expected(Arrival(seq.prompt_ids, seq.stop))


@pytest.mark.parametrize("knob", [False, True])
def test_a_short_prompt_overtakes_long_ones_with_max_long_prefills(knob):
    """S = 4, budget 8; L1 and L2 (24 tokens each) then S (3 tokens), all at clock 0, 3 new tokens each.
    Without the knob, first come first served: L1 takes the whole budget for 3 steps, L2 the rest of it
    for 4, and S's first token comes in step 7. With max_long_prefills 1 and long_prefill_threshold 4: L1
    is long (24 > 4), sliced 4 tokens a step; L2 is long too and one long prompt is already part-way, so it
    stays queued and S, short, passes it: S samples in step 1. L2 is admitted in step 6, when L1 has only
    its last 4 tokens left (no longer long)."""
    kwargs = dict(max_long_prefills=1, long_prefill_threshold=4) if knob else {}
    engine = fake_l8(4, 64, max_batched_tokens=8, **kwargs)
    plans = plans_of(engine)
    long1 = engine.add_request(list(range(24)), StopRule(3))
    long2 = engine.add_request(list(range(30, 54)), StopRule(3))
    short = engine.add_request([60, 61, 62], StopRule(3))
    run_to_end(engine)
    L1, L2, S = long1.seq_id, long2.seq_id, short.seq_id
    assert [ttft_step(engine, s) for s in (long1, long2, short)] == ([6, 11, 1] if knob else [3, 7, 7])
    if knob:
        assert [[(sid, start, end) for sid, start, end, *_ in p] for p in plans[:7]] == [
            [(L1, 0, 4), (S, 0, 3)],
            [(S, 3, 4), (L1, 4, 8)],
            [(S, 4, 5), (L1, 8, 12)],
            [(L1, 12, 16)],
            [(L1, 16, 20)],
            [(L1, 20, 24), (L2, 0, 4)],
            [(L1, 24, 25), (L2, 4, 8)],
        ]
        assert max(end - start for p in plans for _, start, end, decode, _ in p if not decode) == 4
    for seq in (long1, long2, short):
        assert seq.output_ids == expected(Arrival(seq.prompt_ids, seq.stop))


def test_long_prefills_count_what_is_left_after_the_cache_hit():
    """max_long_prefills 1, threshold 4, S = 4, budget 8. A (24 tokens) runs alone in step 1 and caches
    its blocks over its slices; B = A's 24 tokens + 2 arrives once A's prompt is written: 24 of its 26
    tokens are hits, 2 are left, so it is short and is admitted beside C, a long prompt part-way through."""
    engine = fake_l8(4, 64, max_batched_tokens=8, max_long_prefills=1, long_prefill_threshold=4)
    a = engine.add_request(list(range(24)), StopRule(2))
    for _ in range(7):  # 6 slices of 4, then a decode
        engine.step()
    assert a.status is Status.FINISHED
    c = engine.add_request(list(range(40, 60)), StopRule(2))
    engine.step()
    b = engine.add_request(list(range(24)) + [7, 8], StopRule(2))
    engine.step()
    assert b.admitted_at == engine.scheduler.step_no and b.num_cached == 26 and c.num_cached == 8
    assert engine.stats.cached_tokens == 24
    run_to_end(engine)
    for seq in (a, b, c):
        assert seq.output_ids == expected(Arrival(seq.prompt_ids, seq.stop))


@pytest.mark.parametrize("kwargs, named", [
    (dict(max_long_prefills=1), "long-prefill-threshold"), (dict(long_prefill_threshold=8), "max-long-prefills"),
    (dict(max_long_prefills=0, long_prefill_threshold=8), "0"),
    (dict(max_long_prefills=1, long_prefill_threshold=2.5), "2.5"),
])
def test_a_bad_long_prefill_limit_is_one_line_before_anything_is_built(kwargs, named):
    Counting.built = 0
    with pytest.raises(CourseError) as err:
        CountingL8(fake_model(), 4, 8, graphs=False, **kwargs)
    assert "\n" not in str(err.value) and named in str(err.value), str(err.value)
    assert Counting.built == 0


@pytest.mark.parametrize("budget", [8, 64])
@pytest.mark.parametrize("copies", [3, 4])
def test_several_requests_with_one_long_prompt_compute_it_once(copies, budget):
    """S = 4: `copies` requests with the same 22-token prompt, submitted together. The first is admitted
    alone; every later one finds its first block in flight (the first's slices fill it), waits, and is
    admitted once the prompt is written, with (22 - 1) // 4 = 5 hits: 20 cached, 2 computed. At budget 8
    the first's prompt takes 3 steps (8, 8, 6 tokens), so the others are admitted in step 4; at 64, in
    step 2."""
    engine = fake_l8(4, 64, max_running=copies, max_batched_tokens=budget)
    prompt = list(range(5, 27))
    seqs = [engine.add_request(prompt, StopRule(3)) for _ in range(copies)]
    run_to_end(engine)
    later = 4 if budget == 8 else 2
    assert [s.admitted_at for s in seqs] == [1] + [later] * (copies - 1)
    s = engine.stats
    assert (s.prompt_tokens, s.cached_tokens, s.prefill_tokens) == (22 * copies, 20 * (copies - 1),
                                                                   22 + 2 * (copies - 1))
    assert engine.runner.tokens_fed == 22 + 2 * (copies - 1) + 2 * copies  # and 2 decodes each
    assert all(seq.output_ids == expected(Arrival(prompt, StopRule(3))) for seq in seqs)

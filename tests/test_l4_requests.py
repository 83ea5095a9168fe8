"""What a request is, and what L4's engine accepts: requests compare by identity, and bad input is refused
at submission with the engine left exactly as it was (no id, no block, no queue slot, no seed)."""
from collections import deque

import pytest

from fake_runner import VOCAB, FakeRunner, fake_model, reference
from lessons.l2_token_flat.request import Request
from lessons.l4_continuous.engine import L4Engine
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Sequence
from shared.errors import CourseError
from shared.generation import StopRule

STOP = StopRule(4)


def engine(seed: int = 0) -> L4Engine:
    return L4Engine(fake_model(), 4, 20, seed=seed, runner=FakeRunner(4, 20))


def snapshot(e: L4Engine) -> tuple:
    return e._next_id, list(e.scheduler.waiting), list(e.scheduler.running), e.allocator.num_free, e.clock


@pytest.mark.parametrize("make", [lambda: Request([1, 2, 3], 4), lambda: Sequence([1, 2, 3], 4)])
def test_requests_with_equal_prompts_are_two_requests(make):
    first, second = make(), make()
    assert first != second and first == first
    assert len({first, second}) == 2  # hashable, by identity
    queue = deque([first, second])
    queue.remove(second)
    assert len(queue) == 1 and queue[0] is first
    listed = [first, second]
    listed.remove(second)
    assert listed[0] is first


@pytest.mark.parametrize("prompt, sampling, bad", [
    ([1, VOCAB], SamplingParams(), f"{VOCAB}"),
    ([-1, 2], SamplingParams(), "-1"),
    ([1, 2], SamplingParams(stop_token_ids=frozenset({VOCAB + 5})), f"{VOCAB + 5}"),
    ([1, 2], SamplingParams(stop_token_ids=frozenset({-3})), "-3"),
    ([1, 2.0], SamplingParams(), "2.0"),
])
def test_token_ids_outside_the_vocabulary_are_refused_with_nothing_changed(prompt, sampling, bad):
    e = engine()
    running = e.add_request([5, 6, 7], STOP)
    e.step()
    before = snapshot(e)
    with pytest.raises(CourseError, match=rf"{bad}\b.*vocab size {VOCAB}"):
        e.add_request(prompt, STOP, sampling)
    assert snapshot(e) == before
    good = e.add_request([1, 2], STOP)
    while e.scheduler.has_work():
        e.step()  # the refused request never reached the batch, so nothing jams
    assert good.seq_id == 1
    assert running.output_ids == reference([5, 6, 7], 4) and good.output_ids == reference([1, 2], 4)


@pytest.mark.parametrize("seed", [2**64, -1, -2**63, True, 1.5])
def test_an_engine_seed_torch_cannot_take_is_refused(seed):
    with pytest.raises(CourseError, match=f"engine seed must be an integer in .*got {seed!r}"):
        engine(seed)


def test_unseeded_requests_get_the_documented_distinct_seeds():
    e = engine(seed=7)
    a = e.add_request([1, 2], STOP, SamplingParams(1.0))
    b = e.add_request([1, 2], STOP, SamplingParams(1.0))
    seeded = e.add_request([1, 2], STOP, SamplingParams(1.0, seed=5))
    greedy = e.add_request([1, 2], STOP)
    assert a.generator.initial_seed() == 7 * 1_000_003 + 0 == 7_000_021
    assert b.generator.initial_seed() == 7 * 1_000_003 + 1
    assert seeded.generator.initial_seed() == 5 and greedy.generator is None


def test_a_derived_seed_wraps_into_torchs_range():
    top = 2**64 - 1
    seq = engine(seed=top).add_request([1, 2], STOP, SamplingParams(1.0))
    assert seq.generator.initial_seed() == (top * 1_000_003) % 2**64

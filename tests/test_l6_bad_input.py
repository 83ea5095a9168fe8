"""L6's bad input: one-line CourseErrors that change nothing (engine), exit status 2 (smoke)."""
import pytest

from fake_runner import FakeRunner, fake_model
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l6_prefix_sharing import L6Engine
from shared.errors import CourseError
from shared.generation import StopRule
from test_bad_input import run_script


def untouched(engine, num_blocks: int) -> None:
    assert engine.allocator.num_free == num_blocks and all(r == 0 for r in engine.allocator.ref)
    assert not engine.scheduler.has_work() and engine._next_id == 0


@pytest.mark.parametrize("n,sampling,match", [
    (0, SamplingParams(1.0), "n must be at least 1, got 0"),
    (-2, SamplingParams(1.0), "n must be at least 1, got -2"),
    (2, SamplingParams(), "greedy sampling would give 2 identical outputs"),
    (2, SamplingParams(1.0, seed=2**64 - 1), "the last child's seed"),
])
def test_bad_n(n, sampling, match):
    engine = L6Engine(fake_model(), 2, 8, runner=FakeRunner(2, 8))
    with pytest.raises(CourseError, match=match):
        engine.add_parallel([1, 2, 3], StopRule(2), sampling, n=n)
    untouched(engine, 8)


def test_a_shared_prefix_larger_than_the_pool():
    engine = L6Engine(fake_model(), 2, 8, runner=FakeRunner(2, 8))
    engine.add_request(list(range(10)), StopRule(2))
    while engine.scheduler.has_work():
        engine.step()
    with pytest.raises(CourseError, match="the whole pool has 8"):
        engine.add_parallel(list(range(20)), StopRule(2), SamplingParams(1.0), n=3)
    assert engine.allocator.num_free == 8 and all(r == 0 for r in engine.allocator.ref)
    assert not engine.scheduler.has_work()


@pytest.mark.parametrize("policy,match", [("swap", "swap is not supported in L6"), ("lru", "unknown preemption policy 'lru'")])
def test_only_recompute_is_accepted(policy, match):
    with pytest.raises(CourseError, match=match):
        L6Engine(fake_model(), 2, 8, runner=FakeRunner(2, 8), policy=policy)


@pytest.mark.parametrize("argv,message", [
    (["--n", "0"], "n must be at least 1, got 0"),
    (["--n", "2"], "greedy sampling would give 2 identical outputs"),
    (["--policy", "swap"], "swap is not supported in L6"),
    (["--block-size", "4", "--num-blocks", "3"], "the whole pool has 3"),
])
def test_smoke_exits_2(argv, message, capsys):
    code, out, err = run_script("l6_smoke.py", argv, capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err

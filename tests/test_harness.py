"""The benchmark harness (scripts/benchmark/harness.py): the conditions line reads back as printed, rounds
alternate, percentiles come from numpy, and the contention warning fires when it should."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "benchmark"))
import harness  # noqa: E402
from harness import contended  # noqa: E402


@pytest.mark.parametrize("threads, cores, load1, warn", [
    (1, 2, 0.2, False),  # one thread, an idle second core: the quiet case
    (1, 2, 1.1, True),  # one thread, but the other core's worth of load leaves no core idle for it
    (2, 2, 1.1, True),  # two threads and one core already busy: each matmul waits for its slower half
    (2, 16, 3.0, False),  # plenty of idle cores
    (8, 16, 9.0, True),  # more than half the cores busy under a multi-threaded run
])
def test_contended(threads, cores, load1, warn):
    assert contended(threads, cores, load1) is warn


def test_conditions_line_reads_back_field_by_field():
    c = harness.Conditions(commit="1a2b3c4", cpu="AMD EPYC 7B13", flags="avx2 fma", cores=2, threads=1, device="cpu",
                           dtype="bfloat16", backend="cpp", load_before=0.12, load_after=0.8, extra={"clients": "8"})
    assert harness.parse_line(c.line()) == {
        "commit": "1a2b3c4", "cpu": "AMD EPYC 7B13 (avx2 fma)", "cores": "2", "threads": "1", "device": "cpu",
        "dtype": "bfloat16", "backend": "cpp", "load": "0.12 -> 0.80", "clients": "8"}
    assert harness.parse_line(f"`{c.line()}`") == harness.parse_line(c.line())  # as a doc quotes it
    with pytest.raises(ValueError):
        harness.parse_line("commit 1a2b3c4 · cpu x")


def test_rounds_alternate_so_no_system_always_runs_first():
    assert list(harness.alternate(["a", "b", "c"], 2)) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]


def test_percentiles_are_numpy_linear_and_none_when_empty():
    assert harness.percentiles([1, 2, 3, 4], (50, 99)) == {"p50": 2.5, "p99": pytest.approx(3.97)}
    assert harness.percentiles([], (50,)) == {"p50": None}


def test_planned_resolves_auto_and_reads_threads_from_the_command(monkeypatch):
    import argparse

    monkeypatch.setattr(harness, "resolve_backend", lambda name, device, dtype: {"auto": "cpp"}.get(name, name))
    args = argparse.Namespace(device="auto", dtype=None, backend="auto")
    assert harness.planned(args, {"OMP_NUM_THREADS": "1"}, "cpu") == {
        "device": "cpu", "dtype": "float32", "backend": "cpp", "threads": "1"}
    args = argparse.Namespace(device=None, dtype="bfloat16", backend="batched", threads=2)
    assert harness.planned(args, {}, "cuda") == {"device": "cuda", "dtype": "bfloat16", "threads": "2"}

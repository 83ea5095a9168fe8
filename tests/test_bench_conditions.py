"""When bench.py warns that other work shared the CPU (scripts/benchmark/bench_conditions.py)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "benchmark"))
from bench_conditions import contended  # noqa: E402


@pytest.mark.parametrize("threads, cores, load1, warn", [
    (1, 2, 0.2, False),  # one thread, an idle second core: the quiet case
    (1, 2, 1.1, True),  # one thread, but the other core's worth of load leaves no core idle for it
    (2, 2, 1.1, True),  # two threads and one core already busy: each matmul waits for its slower half
    (2, 16, 3.0, False),  # plenty of idle cores
    (8, 16, 9.0, True),  # more than half the cores busy under a multi-threaded run
])
def test_contended(threads, cores, load1, warn):
    assert contended(threads, cores, load1) is warn

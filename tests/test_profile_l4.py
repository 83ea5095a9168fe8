"""scripts/benchmark/profile_l4.py runs and accounts for the run: the engine step is the whole profiled time, and a
bad option is one line with exit 2."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = os.environ | {"OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def profile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/benchmark/profile_l4.py", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow  # the benchmark's own tiny run
def test_profile_of_a_small_run_names_every_seam():
    done = profile("--model", "tiny", "--requests", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    shares = dict(re.findall(r"│ *([a-zA-Z][^│]*?) *│ *[\d.]+ *│ *(\d+)% *│", done.stdout))
    assert shares["engine step (everything below)"] == "100"
    for seam in ("layer matmuls (shared.layers.linear)", "attention backend: run", "vocab projection (model.logits)", "sampling"):
        assert seam in shares, (seam, sorted(shares))
    assert int(shares["model forward (every layer)"]) > 0
    # the harness's conditions line, with the backend the engine really used (not the "auto" asked for)
    line = next(x for x in done.stdout.splitlines() if x.startswith("conditions"))
    assert " · threads 1 · " in line and " · backend auto" not in line and " · model tiny" in line


def test_bad_option_is_one_line():
    done = profile("--requests", "0")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--requests 0" in done.stderr

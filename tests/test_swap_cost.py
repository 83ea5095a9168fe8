"""scripts/benchmark/swap_cost.py at a toy size ends with the harness's conditions line (the backend its runner
really used), so a doc can quote its table in a measured region."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the benchmark's own tiny run
def test_a_toy_run_prints_its_table_and_conditions():
    done = subprocess.run([sys.executable, "scripts/benchmark/swap_cost.py", "--threads", "1", "--tokens", "16",
                           "--repeats", "1"], cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "recompute / swap" in done.stdout
    line = next(x for x in done.stdout.splitlines() if x.startswith("conditions"))
    assert " · threads 1 · " in line and " · backend torch · " in line

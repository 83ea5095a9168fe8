"""scripts/benchmark/l8_bench.py on a tiny workload (seconds on one CPU thread): the conditions line it prints
names the attention backend the engines really used, and its JSON report carries that line, every round, and
parity with L7 for every engine. The docs quote this line above the tables the full run produces."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import harness  # noqa: E402

SCRIPT = ROOT / "scripts" / "benchmark" / "l8_bench.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow  # the benchmark itself, on the tiny model
def test_a_tiny_sweep_prints_its_conditions_and_keeps_parity(tmp_path):
    out = tmp_path / "l8.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--budgets", "8,64", "--shorts", "2", "--longs", "1",
                          "--long-len", "40", "60", "--repeats", "2", "--no-png", "--json", str(out)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("conditions" + harness.SEP))
    fields = harness.parse_line(line)
    assert fields["backend"] == harness.resolve_backend("auto")  # resolved, not the option's "auto"
    assert (fields["device"], fields["dtype"], fields["threads"]) == ("cpu", "float32", "1")
    report = json.loads(out.read_text())
    assert report["conditions_line"] == line and report["conditions"]["backend"] == fields["backend"]
    engines = report["engines"]
    assert [e["engine"] for e in engines] == ["L7 (whole prompts)", "L8 budget 8", "L8 budget 64"]
    assert all(e["parity"] and len(e["rounds"]) == 2 and e["short_gap_p99_s"] is not None for e in engines)


def test_a_bad_option_is_one_line_before_any_engine_runs():
    run = subprocess.run([sys.executable, str(SCRIPT), "--longs", "-1", "--no-png"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip() == "error: --longs must be at least 0, got -1"

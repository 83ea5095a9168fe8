"""scripts/benchmark/l10_bench.py on a tiny workload (seconds on one CPU thread per rank): the conditions line
names the attention backend rank 0's engine really used and the busiest thread count, the children alternate
(tp 1, 2, 2, 1) and pool their runs, tp 2 keeps tp 1's tokens, and the JSON and PNG carry the conditions."""
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

SCRIPT = ROOT / "scripts" / "benchmark" / "l10_bench.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow  # the benchmark itself, on the tiny model
def test_a_tiny_run_prints_its_conditions_alternates_and_keeps_parity(tmp_path):
    out, png = tmp_path / "l10.json", tmp_path / "l10.png"
    run = subprocess.run([sys.executable, str(SCRIPT), "--requests", "2", "--prompt-len", "20", "40", "--new-tokens",
                          "4", "--repeats", "1", "--rounds", "2", "--json", str(out), "--png", str(png)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("conditions" + harness.SEP))
    fields = harness.parse_line(line)
    assert fields["backend"] == harness.resolve_backend("auto")  # resolved by rank 0's engine, not "auto"
    assert (fields["device"], fields["dtype"], fields["threads"]) == ("cpu", "float32", "1")
    assert (fields["tp"], fields["busiest"]) == ("1,2", "2 threads")  # tp 2: two processes of one thread
    report = json.loads(out.read_text())
    assert report["conditions_line"] == line and report["png"] == str(png) and png.stat().st_size > 0
    assert [c["tp"] for c in report["children"]] == [1, 2, 2, 1]  # harness.alternate's order
    assert [(r["tp"], r["runs"], r["parity"]) for r in report["tp"]] == [(1, 2, True), (2, 2, True)]
    assert report["tp"][1]["all_reduces_per_step"] > 0 == report["tp"][0]["all_reduces_per_step"]


def test_a_bad_option_is_one_line_before_any_process_starts():
    run = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip() == "error: --rounds must be at least 1, got 0"

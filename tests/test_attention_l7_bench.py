"""attention_bench.py and l7_bench.py end with the harness's conditions line, naming the backends they really
timed, so a doc's measured table (tests/test_doc_measured.py) can be checked against what the command runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import harness  # noqa: E402


def last_conditions(script: str, *args: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    out = subprocess.run([sys.executable, f"scripts/benchmark/{script}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("conditions")]
    assert len(lines) == 1, out.stdout
    return harness.parse_line(lines[0])


def test_attention_bench_names_every_backend_it_timed():
    got = last_conditions("attention_bench.py", "--requests", "3", "--max-history", "64", "--rounds", "1",
                          "--calls", "1", "--no-prefill")
    assert got["threads"] == "1" and got["dtype"] == "float32" and got["device"] == "cpu"
    assert got["backend"].split(",")[:2] == ["torch", "batched"]  # then cpp, where the kernel builds


def test_l7_bench_names_the_backend_auto_resolved_to():
    got = last_conditions("l7_bench.py", "--steps", "1", "--batch-sizes", "2")
    assert got["backend"] == harness.resolve_backend("auto")
    assert got["model"] == "embedded" and got["threads"] == "1"

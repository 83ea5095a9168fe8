"""scripts/benchmark/l11_real.py, the L11 measurement on a trained model, run on the embedded model (its random
weights draft nothing useful, but the machinery is the same): every system's outputs checked against the plain
engine's, the early exit's acceptance per position and its logit lens printed, bad options refused in one line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import l11_real  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark" / "l11_real.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1", "COLUMNS": "200",
                                                                            "PATH": "/usr/bin:/bin"})


def test_the_copy_tasks_copy_from_their_prompt():
    tasks = l11_real.copy_tasks()
    assert len(tasks) == len(set(tasks)) == 16
    assert l11_real.misspell("three fourth, fifth sixth. seven eights") == "three fuorth, fifth sixth. seven egihts"
    for p, f in zip(l11_real.PARAGRAPHS, l11_real.FUNCTIONS):
        assert sum(p in t for t in tasks) == 2 and sum(f in t for t in tasks) == 1


@pytest.mark.slow  # the benchmark itself, on the tiny model
def test_a_small_run_checks_parity_and_reports_every_system(tiny_dir, tmp_path):
    out = tmp_path / "rows.json"
    p = run("--model", str(tiny_dir), "--prompts", "chat", "--batches", "1,4", "--max-new-tokens", "6",
            "--draft-layers", "2", "--json", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "chat, batch 1: every system's outputs equal the plain engine's" in p.stdout
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["system"]) for r in rows] == [(1, "none"), (1, "ngram"), (1, "early exit 2"),
                                                         (4, "none"), (4, "ngram")]
    early = rows[2]
    assert early["drafted"] > 0 and len(early["accepted_at_position"]) == 4
    assert "L=4" not in p.stdout.split("early exit, teacher-forced")[1].splitlines()[1]  # the tiny model has 4 layers
    assert "conditions · " in p.stdout


@pytest.mark.parametrize("argv,message", [
    (["--draft-layers", "9"], "--draft-layers must be 1 to 3 (the target has 4 layers), got 9"),
    (["--prompts", "poems"], "prompt sets are copy, chat"),
    (["--batches", "0"], "integers of at least 1"),
])
def test_bad_values_are_one_line_exit_2(tiny_dir, argv, message):
    p = run("--model", str(tiny_dir), *argv)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and message in lines[-1] and len([x for x in lines if x.startswith("error")]) == 1

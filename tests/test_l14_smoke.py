"""scripts/l14_smoke.py's contract: --json carries parity and the invariance checks; with --batch-invariant off the
same checks fail (exit 1), naming the first differing logit; bad input is one line and exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = [sys.executable, str(ROOT / "scripts" / "l14_smoke.py")]
SHORT = ["--prompt", "The capital of France is a city whose long history", "--max-new-tokens", "4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def smoke(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SMOKE, *args], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)


@pytest.mark.slow  # the doc test runs the smoke itself; this reads its JSON
def test_json_carries_parity_and_every_invariance_check():
    r = smoke(*SHORT, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["match"] and out["prompts"][0]["L14"] == out["prompts"][0]["hf"]
    check = out["extra_check"]
    assert check["ok"] and check["message"].count("PASS ") == 7 and "FAIL" not in check["message"]


@pytest.mark.slow
def test_the_default_mode_fails_the_same_checks_and_names_the_bits():
    r = smoke(*SHORT, "--batch-invariant", "off")
    assert r.returncode == 1, r.stdout[-2000:]
    assert "PASS: every prompt matches HF" in r.stdout  # tokens are the same; the bits are not
    assert "FAIL alone = in a batch of 9" in r.stdout and "highest differing bit:" in r.stdout


@pytest.mark.parametrize("args, line", [
    (["--backend", "torch"], "error: --batch-invariant attends with the C++ kernel (--backend cpp or auto), not "
                             "--backend torch: the torch backends pick their matmul kernels by the step's shape"),
    (["--dtype", "float16"], "error: --batch-invariant computes in float32 or bfloat16, not float16"),
    (["--batch-invariant", "maybe"], None),
])
def test_bad_input_is_one_line_and_exit_2(args, line):
    r = smoke(*args)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    if line is not None:
        assert r.stderr.strip() == line
    else:
        assert "--batch-invariant" in r.stderr and "maybe" in r.stderr

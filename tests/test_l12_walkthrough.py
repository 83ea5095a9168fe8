"""scripts/l12_walkthrough.py: the hand quantization of one K row agrees with the pool's bytes and the kernel."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "l12_walkthrough.py"


def walk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}, timeout=300)


def test_the_row_round_trips_lives_in_its_slot_and_the_kernel_agrees():
    from test_doc_claims import run_doc_command

    run = run_doc_command("python scripts/l12_walkthrough.py")  # the doc tests' run (memoised), not a second one
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "within it: yes" in out  # every value off by at most half a step
    assert "position 5 -> entry 1 (block 2), offset 1 -> slot 2 x 4 + 1 = 9" in out
    assert "= [N, S, Hkv, D + 4]" in out
    assert "codes and scale equal the hand computation" in out  # the row's bytes are the codes, then the scale
    assert "the oracle reading them again agrees within 1e-5: yes" in out


def test_another_layer_and_head():
    run = walk("--layer", "3", "--head", "1", "--position", "0")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "position 0 -> entry 0 (block 1), offset 0" in run.stdout


def test_a_head_out_of_range_is_one_line():
    run = walk("--head", "2")
    assert run.returncode == 2
    assert "--head 2: choose 0..1" in run.stderr

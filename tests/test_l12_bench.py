"""scripts/benchmark/l12_bench.py at tiny sizes (seconds): one run prints the three sections, both target lines
with a verdict, and a conditions line that its own planned() (what tests/test_doc_measured.py compares a doc's
table with) agrees with; capacity follows the pool arithmetic; a bad option is one line, exit 2. No timings
are asserted."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import harness  # noqa: E402

SCRIPT = ROOT / "scripts" / "benchmark" / "l12_bench.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
TINY = ["--model", "tiny", "--pool-mib", "0.5", "--prompt-len", "16", "--new-tokens", "4", "--rounds", "2",
        "--histories", "32,48", "--attn-batch", "2", "--attn-rounds", "1", "--attn-calls", "1"]


def load_bench():
    spec = importlib.util.spec_from_file_location("l12_bench_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("l12") / "l12.json"
    run = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--json", str(out)], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout, json.loads(out.read_text())


@pytest.mark.slow  # the benchmark's own tiny run
def test_the_run_prints_three_sections_targets_and_conditions(tiny_run):
    stdout, report = tiny_run
    assert "a + b. tiny model, a pool of 0.5 MiB" in stdout and "c. one layer's decode attention" in stdout
    targets = [line for line in stdout.splitlines() if line.startswith("target: ")]
    assert len(targets) == 2 and all(t.endswith("MET") or " MET;" in t for t in targets), targets  # a verdict each
    assert "1.9x the bf16 blocks in the same bytes" in targets[0] and "no slower than bf16's" in targets[1]
    line = next(x for x in stdout.splitlines() if x.startswith("conditions" + harness.SEP))
    fields = harness.parse_line(line)
    assert report["conditions_line"] == line
    plan = load_bench().planned(load_bench().parser().parse_args(TINY), {"OMP_NUM_THREADS": "1"}, "cpu")
    assert {k: fields[k] for k in plan} == plan  # what the doc test will compare a pasted table with
    assert (fields["model"], fields["pool"], fields["requests"]) == ("tiny", "0.5 MiB", "16+4")


def test_capacity_follows_the_pool_arithmetic(tiny_run):
    from lessons.l12_kv_quant.kv_pool import block_bytes
    from shared.config import Qwen3Config
    from shared.tiny_qwen3 import default_model_dir

    _, report = tiny_run
    cfg = Qwen3Config.from_dir(default_model_dir())
    kv = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
    for row in report["capacity_decode"]:
        blocks = int(0.5 * 1024**2) // block_bytes(cfg, 16, kv[row["kv"]])
        assert (row["blocks"], row["requests"]) == (blocks, blocks // 2)  # 16 + 4 tokens: 2 blocks a request
        assert row["peak_running"] == row["requests"] and row["preemptions"] == 0  # all held at once, as claimed
    formats = [r["format"] for r in report["attention"]]
    assert formats == ["fp32", "bf16", "int8"] * 2
    per_token = {r["format"]: r["bytes_per_token"] for r in report["attention"]}
    assert per_token == {"fp32": 2 * 8 * 128 * 4, "bf16": 2 * 8 * 128 * 2, "int8": 2 * 8 * 132}


def test_a_bad_option_is_one_line():
    run = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().startswith("error: ") and len(run.stderr.splitlines()) == 1

"""scripts/benchmark/l15_bench.py at tiny sizes: the transfer part (seconds, one thread) prints a row of real numbers
for each page dtype and length, the byte counts the page layout implies, and a conditions line its JSON repeats; the
serve part (slow: it starts five servers) prints a row per setup, D pulled every request's pages, no request failed;
bad options are one line and exit 2. No timing is asserted."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import harness  # noqa: E402
from shared.errors import CourseError  # noqa: E402

SCRIPT = ROOT / "scripts" / "benchmark" / "l15_bench.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
NUMBER = r"[\d,]+(?:\.\d+)?"


def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def conditions(stdout: str) -> list[str]:
    return [x for x in stdout.splitlines() if x.startswith("conditions" + harness.SEP)]


def test_the_transfer_part_prints_a_row_of_numbers_per_dtype_and_length_and_its_conditions(tmp_path):
    from shared.config import Qwen3Config
    from shared.tiny_qwen3 import default_model_dir

    out = tmp_path / "l15.json"
    r = run(["--part", "transfer", "--lengths", "33,64", "--repeats", "1", "--json", str(out)], timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if re.match(r"^│ (fp32|int8) ", line)]
    assert len(rows) == 4, r.stdout
    for line in rows:  # pages, prompt, blocks, MB, pull ms, MB/s, B/token, recompute ms, ratio, pull + tail, ratio
        cells = [c.strip() for c in line.strip("│").split("│")]
        assert all(re.fullmatch(NUMBER, c) for c in cells[1:11]), line
        assert re.fullmatch(rf"{NUMBER} -> {NUMBER}", cells[11]), line  # the load as the row started and ended
    [line] = conditions(r.stdout)
    fields = harness.parse_line(line)
    assert (fields["device"], fields["dtype"], fields["threads"], fields["model"], fields["part"]) == \
        ("cpu", "float32", "1", "tiny", "transfer")
    assert fields["backend"] == harness.resolve_backend("auto")
    report = json.loads(out.read_text())
    assert report["conditions_line"] == report["transfer"]["conditions_line"] == line
    c = Qwen3Config.from_dir(default_model_dir())
    per_token = {"fp32": 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4,
                 "int8": 2 * c.num_hidden_layers * c.num_key_value_heads * (c.head_dim + 4)}  # int8 rows: + a scale
    for row in report["transfer"]["rows"]:
        blocks = (row["prompt_tokens"] - 1) // 16  # full blocks before the last token travel
        assert row["blocks"] == blocks and row["bytes"] == blocks * 16 * per_token[row["pages"]], row
        assert row["pull_s"] > 0 and row["recompute_s"] > 0 and row["pull_and_tail_s"] > row["pull_s"]


@pytest.mark.slow  # five servers start, one setup after another
def test_the_serve_part_prints_a_row_per_setup_and_d_pulled_every_prompt(tmp_path):
    out = tmp_path / "l15.json"
    r = run(["--part", "serve", "--window", "4", "--long-every", "2", "--long-len", "200", "--clients", "2",
             "--json", str(out)], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    setups = report["serve"]["setups"]
    assert [s["setup"] for s in setups] == ["(a) colocated", "(b) colocated, chunked", "(c) disaggregated"]
    for s in setups:
        assert not s["failed"] and s["short_requests"] >= 2 and s["long_requests"] == 2, s
        assert s["itl_ms"]["p50"] > 0 and s["long_ttft_ms"]["p99"] > 0 and s["output_tok_s"] > 0
    pulls = setups[2]["d_pulls"]  # every request through the proxy, plus the two warm-ups, pulled its pages
    assert pulls["pulled"] == setups[2]["short_requests"] + 2 + 2 and pulls["recomputed"] == 0, pulls
    [line] = conditions(r.stdout)
    assert harness.parse_line(line)["part"] == "serve" and report["conditions_line"] == line


def load_bench():
    spec = importlib.util.spec_from_file_location("l15_bench_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def test_bad_options_are_one_line_and_exit_2(capsys):
    r = run(["--repeats", "0"], timeout=120)  # as a user sees it: one line, nothing on stdout
    assert (r.returncode, r.stderr, r.stdout) == (2, "error: --repeats must be at least 1, got 0\n", "")
    bench = load_bench()
    refused = {("--lengths", "128,x"): "--lengths '128,x': give token counts separated by commas, e.g. "
                                       "128,512,1024,2048",
               ("--lengths", "16"): "--lengths 16: a prompt needs more than 16 tokens for one full block to travel",
               ("--lengths", "5000"): "--lengths: 5000 tokens and the first output token exceed the model's context "
                                      "of 4096",
               ("--clients", "0"): "--clients must be at least 1, got 0",
               ("--window", "nan"): "--window must be a positive number of seconds, got nan",
               ("--long-every", "40"): "--long-every must be positive and at most --window (30 s), got 40",
               ("--long-len", "10"): "--long-len must be more than 16 tokens, got 10",
               ("--chunk-budget", "0"): "--chunk-budget must be at least 1, got 0",
               ("--model", "/no/such/dir"): "model directory /no/such/dir does not exist"}
    for argv, message in refused.items():
        with pytest.raises(CourseError) as e:
            bench.settings(bench.parser().parse_args(list(argv)))
        assert str(e.value) == message
    with pytest.raises(SystemExit) as e:
        bench.parser().parse_args(["--part", "decode"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: argument --part: invalid choice")

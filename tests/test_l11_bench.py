"""scripts/benchmark/l11_bench.py curve on a tiny setting (a few seconds, one thread): every (model, batch, q)
cell is measured and reported with its ratio to q = 1, the runner scores one row per fed token (the script
stops otherwise), the conditions line names the backend really used, and the verdict sorts cells by the
free ratio."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import harness  # noqa: E402

SCRIPT = ROOT / "scripts" / "benchmark" / "l11_bench.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def load():
    spec = importlib.util.spec_from_file_location("l11_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tiny_curve_reports_every_cell(tmp_path):
    out, png = tmp_path / "curve.json", tmp_path / "curve.png"
    run = subprocess.run([sys.executable, str(SCRIPT), "curve", "--models", "tiny", "--batches", "1,2", "--queries",
                          "1,2,3", "--rounds", "1", "--warmup", "0", "--history", "32", "--json", str(out),
                          "--png", str(png)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("conditions" + harness.SEP))
    fields = harness.parse_line(line)
    assert fields["backend"] == harness.resolve_backend("auto")  # what the runner used, not "auto"
    assert (fields["device"], fields["dtype"], fields["threads"], fields["history"]) == ("cpu", "float32", "1", "32")
    report = json.loads(out.read_text())
    assert report["conditions_line"] == line and png.stat().st_size > 0
    rows = report["rows"]
    assert [(r["model"], r["batch"], r["q"]) for r in rows] == [("tiny", b, q) for b in (1, 2) for q in (1, 2, 3)]
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["q"] == 1)
        assert r["tokens"] == r["batch"] * r["q"] and r["drafts"] == r["q"] - 1 and len(r["ms_all"]) == 1
        assert abs(r["x_q1"] - r["ms"] / base["ms"]) < 1e-9 and r["ms"] > 0
        assert r["free"] == (r["q"] > 1 and r["x_q1"] < report["free"])
    assert [(r["rows"], r["shape"]) for r in report["lm_head"]] == [(m, [151936, 128]) for m in (1, 2, 3)]
    assert "tiny, batch 1 (q = 1:" in run.stdout and "tiny, batch 2 (q = 1:" in run.stdout
    assert "x q=1" in run.stdout and "K=2" in run.stdout


def test_verdicts_sort_each_q_by_the_free_ratio():
    bench = load()
    rows = [{"model": "m", "batch": 4, "q": q, "ms": ms, "x_q1": ms / 10, "free": q > 1 and ms / 10 < 1.3}
            for q, ms in ((1, 10.0), (2, 20.0), (4, 12.0), (8, 30.0))]
    (line,) = bench.verdicts(rows, 1.3)
    assert line == ("m, batch 4 (q = 1: 10.00 ms): nearly free (< 1.3x) at q = 4 (1.20x); "
                    "not at q = 2 (2.00x), 8 (3.00x)")


def test_the_doc_command_parses_and_plans_one_thread_fp32_cpu():
    args = load().parser().parse_args(["curve"])
    assert (args.models, args.batches, args.queries, args.history) == (["tiny", "bench"], [1, 4, 16],
                                                                       [1, 2, 4, 8, 16], 512)
    plan = harness.planned(args, {"OMP_NUM_THREADS": "1"}, "cpu")
    assert plan == {"device": "cpu", "dtype": "float32", "backend": harness.resolve_backend("auto"), "threads": "1"}


def test_a_bad_option_is_one_line():
    run = subprocess.run([sys.executable, str(SCRIPT), "curve", "--queries", "0,2"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("error:"), run.stderr

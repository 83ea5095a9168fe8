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

import pytest

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


@pytest.mark.slow  # the benchmark's own tiny run
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
    assert all(r["ms"] > 0 and r["ms_w_xt"] > 0 for r in report["lm_head"])
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


# ----- speedup -----

@pytest.mark.slow  # the benchmark's own tiny run
def test_a_tiny_speedup_checks_parity_and_reports_every_system(tmp_path):
    """Batches 1 and 2, rates 0 and 1, the n-gram drafter: every run's outputs equal the plain engine's (the
    script stops otherwise), speculation's counters add up, and the table, the break-even lines, the verdict
    and the conditions line are printed."""
    out, png = tmp_path / "speedup.json", tmp_path / "speedup.png"
    run = subprocess.run([sys.executable, str(SCRIPT), "speedup", "--model", "tiny", "--batches", "1,2", "--alphas",
                          "0,1", "--max-new-tokens", "8", "--prompt-len", "20-24", "--rounds", "2", "--json", str(out),
                          "--png", str(png)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("conditions" + harness.SEP))
    fields = harness.parse_line(line)
    assert fields["backend"] == harness.resolve_backend("auto")
    assert (fields["device"], fields["dtype"], fields["threads"], fields["model"], fields["K"], fields["new"],
            fields["rounds"]) == ("cpu", "float32", "1", "tiny", "4", "8", "2")
    report = json.loads(out.read_text())
    assert report["conditions_line"] == line and png.stat().st_size > 0
    rows = {(r["batch"], r["system"]): r for r in report["rows"]}
    assert list(rows) == [(b, s) for b in (1, 2) for s in ("none", "replay 0", "replay 1", "ngram")]
    for (b, system), r in rows.items():
        assert r["decode_tokens"] == b * 7  # 8 new tokens each, the first from the prompt's step
        assert len(r["speedup_rounds"]) == 2 and r["speedup"] > 0
        if system != "none":
            assert r["spec"]["emitted"] == 2 * r["decode_tokens"]  # every decode token came from a decode row
    for b in (1, 2):
        none, zero, one = rows[(b, "none")], rows[(b, "replay 0")], rows[(b, "replay 1")]
        assert none["speedup_rounds"] == [1.0, 1.0] and none["tokens_per_forward"] == b
        assert zero["spec"]["accepted"] == 0 and zero["spec"]["drafted"] > 0 and zero["tokens_per_row"] == 1.0
        # rate 1: the first verify row keeps 4 drafts + the bonus (6 tokens), the last 1 draft + its own (8)
        assert one["spec"]["acceptance_rate"] == 1.0 and one["spec"]["verify_rows"] == 2 * 2 * b
        assert one["tokens_per_forward"] == 7 * b / 2 and one["formula"] == 5.0
    assert "batch 1: break-even acceptance" in run.stdout and "batch 2, n-gram drafter" in run.stdout
    assert "not evaluated (this run is not that setting)" in run.stdout
    assert "every output equal to the plain engine's" in run.stdout


def test_a_speculative_output_that_differs_stops_the_benchmark(monkeypatch):
    import io
    from types import SimpleNamespace

    import pytest
    from rich.console import Console

    bench = load()

    class FakeRun:  # done at once; a "speculative" run got one token wrong
        def __init__(self, model, prompts, drafter, args):
            self.outputs = [[5, 6, 7] for _ in prompts] if drafter is None else [[5, 6, 8] for _ in prompts]
            self.busy = False

        def result(self):
            return {"outputs": self.outputs, "backend": "cpp"}

    monkeypatch.setattr(bench, "Run", FakeRun)
    args = bench.parser().parse_args(["speedup", "--model", "tiny", "--batches", "2", "--rounds", "1"])
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=1000))
    with pytest.raises(RuntimeError, match="parity broken: batch 2, replay 0, request 0"):
        bench.measure_batch(model, 2, args, Console(file=io.StringIO()))


def test_the_formula_break_even_and_verdict():
    bench = load()
    assert abs(bench.expected_tokens_per_step(0.8, 4) - 3.3616) < 1e-12 and bench.expected_tokens_per_step(1, 4) == 5
    assert abs(bench.expected_acceptance(0.5, 4) - (0.5 + 0.25 + 0.125 + 0.0625) / 4) < 1e-12
    assert abs(bench.break_even([(0, 0.5), (0.5, 0.9), (0.8, 1.5)]) - 0.55) < 1e-12
    assert bench.break_even([(0, 1.1), (1, 2.0)]) is None and bench.break_even([(0, 0.5), (1, 0.9)]) is None
    alpha = bench.formula_break_even(1.69, 4)
    assert abs(bench.expected_tokens_per_step(alpha, 4) - 1.69) < 1e-9
    assert bench.formula_break_even(0.9, 4) == 0.0 and bench.formula_break_even(5.5, 4) is None
    args = bench.parser().parse_args(["speedup"])
    row = {"batch": 1, "alpha": 0.8, "speedup": 1.9, "speedup_rounds": [1.8, 2.1], "tokens_per_forward": 3.3,
           "formula": 3.36, "step_cost": 1.68}
    assert "NOT MET, borderline: rounds on both sides of it -- measured 1.900x" in bench.target_verdict([row], args)
    assert "(the formula over that cost: 2.00x)" in bench.target_verdict([row], args)
    assert ": MET -- measured 2.100x" in bench.target_verdict([{**row, "speedup": 2.1, "speedup_rounds": [2.05, 2.2]}],
                                                              args)
    tiny = bench.parser().parse_args(["speedup", "--model", "tiny"])
    assert "not evaluated" in bench.target_verdict([row], tiny)


def test_the_speedup_command_parses_and_plans_one_thread_fp32_cpu():
    import pytest

    args = load().parser().parse_args(["speedup"])
    assert (args.model, args.batches, args.alphas, args.k, args.prompt_len, args.ngram) == (
        "bench", [1, 4, 16], [0.0, 0.5, 0.8, 1.0], 4, (32, 64), True)
    plan = harness.planned(args, {"OMP_NUM_THREADS": "1"}, "cpu")
    assert plan == {"device": "cpu", "dtype": "float32", "backend": harness.resolve_backend("auto"), "threads": "1"}
    for bad in (["--alphas", "0,1.5"], ["--prompt-len", "10-20"], ["--batches", "0"]):
        with pytest.raises(SystemExit) as exit_:
            load().parser().parse_args(["speedup", *bad])
        assert exit_.value.code == 2
    run = subprocess.run([sys.executable, str(SCRIPT), "speedup", "--k", "0"], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("error:"), run.stderr

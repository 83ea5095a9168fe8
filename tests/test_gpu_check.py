"""scripts/gpu_check.py's plumbing, on CPU: the refusal without CUDA, the checks it plans, how it judges them,
and the report a GPU owner pastes. Nothing here runs on a GPU; the checks themselves are the smokes'."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.gpu_check import Check, Result, judge, plan, report, smoke_options  # noqa: E402
from scripts.checks.parity_matrix import Outcome, discover  # noqa: E402

NO_CUDA = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_without_cuda_it_refuses_in_one_line_with_exit_2():
    r = subprocess.run([sys.executable, "scripts/gpu_check.py"], capture_output=True, text=True, cwd=ROOT, env=NO_CUDA)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: no CUDA GPU visible to torch"), r.stderr


def options():
    """What the smokes take, as gpu_check reads it from --help: L3 on have --backend, L7 to L13 --graphs, L10 to L12
    --tp, L12 --kv-dtype (L13's smoke has neither: one rank, the model's own KV dtype), L14 --batch-invariant, L16
    --weights."""
    def takes(n: int) -> set[str]:
        return {opt for opt, first, last in (("--backend", 3, 99), ("--graphs", 7, 13), ("--tp", 10, 12),
                                             ("--kv-dtype", 12, 12), ("--batch-invariant", 14, 14),
                                             ("--weights", 16, 99))
                if first <= n <= last}

    return {s: takes(int(s.name[1:].split("_")[0])) for s in discover(ROOT / "scripts")}


def test_the_plan_covers_every_smoke_both_backends_graphs_on_and_off_the_bench_and_the_contract_tests():
    checks = plan(None, options())
    cpu = [c for c in checks if c.kind == "smoke" and c.name.endswith("on the CPU")]
    smokes = [c for c in checks if c.kind == "smoke" and c not in cpu]
    assert all(("--device", "cuda") == c.argv[2:4] and ("--dtype", "bfloat16") == c.argv[4:6] for c in smokes)
    names = [c.name for c in smokes]
    assert names[:2] == ["L1", "L2"]
    for lesson in ("L3", "L4", "L5", "L6"):
        assert f"{lesson} flashinfer" in names and f"{lesson} torch" in names
    for lesson in ("L7", "L8", "L9", "L10", "L11", "L12", "L13"):
        assert {f"{lesson} flashinfer graphs on", f"{lesson} flashinfer graphs off", f"{lesson} torch"} <= set(names)
    assert {"L14 flashinfer", "L14 torch", "L15 flashinfer", "L15 torch", "L16 flashinfer", "L16 torch"} <= set(names)
    assert len(smokes) == 2 + 2 * 4 + 7 * 3 + 2 + 2 + 2 == len(set(names))
    # L16's blocks are the CPU's: on CUDA its smoke runs bf16 weights; the blocks once on the CPU, exact against HF
    assert all(c.argv[c.argv.index("--weights") + 1] == "bf16" for c in smokes if c.name.startswith("L16"))
    assert [c.command() for c in cpu] == [
        "python scripts/l16_smoke.py --json --device cpu --weights q4_1 --parity"]
    # L14's mode runs on the CPU: on CUDA its smoke checks L13's engine's parity; the probe measures the GPU's recipe
    assert all(c.argv[c.argv.index("--batch-invariant") + 1] == "off" for c in smokes if c.name.startswith("L14"))
    # int8 pages are read by the CPU kernel only: on CUDA, L12's smoke checks HF parity in the model's dtype
    assert all(c.argv[c.argv.index("--kv-dtype") + 1] == "auto" for c in smokes if c.name.startswith("L12"))
    tp = {c.argv[c.argv.index("--tp") + 1] for c in smokes if "--tp" in c.argv}
    assert tp == {"1"} and all(("--tp" in c.argv) == c.name.startswith(("L10", "L11", "L12")) for c in smokes)
    assert {c.argv[c.argv.index("--tp") + 1] for c in plan(None, options(), gpus=4) if "--tp" in c.argv} == {"2"}
    assert [c.command() for c in checks if c.kind != "smoke"] == [
        "python scripts/benchmark/l7_bench.py --device cuda",
        "python scripts/benchmark/l8_bench.py --device cuda --quick --no-png",
        "python scripts/gpu_check.py --l12-fp8",
        "python scripts/checks/gpu_invariance.py",
        "python -m pytest -q tests/test_l3_flashinfer_contract.py tests/test_l7_flashinfer_contract.py "
        "tests/test_l8_flashinfer_contract.py tests/test_l12_fp8.py"]


def test_l13s_smoke_is_planned_from_its_own_help_on_cuda_with_each_backend():
    """Read from the script itself: L13's smoke takes --backend and --graphs, and neither --tp nor --kv-dtype."""
    script = ROOT / "scripts" / "l13_smoke.py"
    assert smoke_options(script) == {"--backend", "--graphs"}
    checks = plan(None, {script: smoke_options(script)})
    assert [c.command() for c in checks if c.kind == "smoke"] == [
        "python scripts/l13_smoke.py --json --device cuda --dtype bfloat16 --backend flashinfer --graphs on",
        "python scripts/l13_smoke.py --json --device cuda --dtype bfloat16 --backend flashinfer --graphs off",
        "python scripts/l13_smoke.py --json --device cuda --dtype bfloat16 --backend torch"]


def test_a_model_repeats_every_check_but_the_contract_tests_on_that_checkpoint():
    base, with_model = plan(None, options()), plan("/ckpt", options())
    mine = [c for c in with_model if c.model == "/ckpt"]
    assert len(with_model) == 2 * len(base) - 2 and len(mine) == len(base) - 2  # the probe and the tests: once
    assert all(c.argv[c.argv.index("--model") + 1] == "/ckpt" for c in mine)
    assert sum(c.kind == "pytest" for c in with_model) == 1


def test_smokes_are_judged_like_the_parity_matrix_and_skipped_contract_tests_are_not_a_pass():
    smoke = Check("L3 torch", "embedded", ("scripts/l3_smoke.py",), "smoke")
    assert judge(smoke, 0, '{"prompts": [], "match": true}', "").status == "PASS"
    assert judge(smoke, 1, "", "Traceback ...").status == "ERROR"
    tests = Check("FlashInfer contract tests", "-", ("-m", "pytest"), "pytest")
    assert judge(tests, 0, "12 passed in 3.1s", "") == Outcome("PASS", "12 passed in 3.1s")
    assert judge(tests, 0, "12 skipped in 0.1s", "").status == "ERROR"
    assert judge(tests, 1, "1 failed, 11 passed", "").status == "FAIL"
    bench = Check("l7_bench", "embedded", ("scripts/benchmark/l7_bench.py",), "bench")
    assert judge(bench, 2, "", "error: --device cuda asked for").note == "exit 2: error: --device cuda asked for"


def test_the_report_is_markdown_with_every_check_its_result_and_the_bench_table():
    checks = plan(None, options())
    results = [Result(c, Outcome("FAIL" if c.name == "L3 torch" else "PASS", "a | note" if c.name == "L3 torch" else ""),
                      1.25, "batch ...\n1 1 0.50 0.20 0.40" if c.kind == "bench" else "") for c in checks]
    text = report(["- GPU 0: test"], results)
    lines = text.splitlines()
    assert lines[0] == "## GPU check: paged attention, lesson by lesson" and "- GPU 0: test" in lines
    assert f"{len(checks)} checks, 1 failed or errored." in lines
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| check")]
    assert len(rows) == len(checks)
    assert "| L3 torch | embedded | FAIL | 1.2 | `python scripts/l3_smoke.py --json --device cuda --dtype bfloat16 " \
           "--backend torch` | a \\| note |" in rows
    benches = sum(c.kind == "bench" for c in checks)  # l7_bench, l8_bench, L12 fp8, L14's probe: a fenced block each
    assert "1 1 0.50 0.20 0.40" in text and text.count("```") == 2 * benches == 8


@pytest.mark.parametrize("argv, message", [(["--model", " "], "--model is empty"), (["--bogus"], "unrecognized")])
def test_bad_options_are_one_line_exit_2(argv, message):
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", *argv], capture_output=True, text=True, cwd=ROOT,
                       env=NO_CUDA)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1


def test_the_gpu_invariance_probe_refuses_a_machine_without_cuda_in_one_line():
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the probe would measure")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "checks" / "gpu_invariance.py")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == "error: gpu_invariance.py measures on a CUDA GPU; torch sees none here\n"

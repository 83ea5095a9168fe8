"""scripts/l12_smoke.py end to end: with no arguments (int8 pages) it prints the pool's blocks against bf16's and
fp32's in the same bytes and the quality contract's two lines, and exits 0; --kv-dtype auto is L11's smoke (HF
parity); bad values are one line and exit 2; a failing contract names its worst position and both top tokens.
The two full runs are processes of their own, each made once (each costs seconds; the no-argument one is the doc
tests' own run of the command, shared)."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lessons.l12_kv_quant.quality import Quality, Worst, judge
from test_bad_input import ROOT, run_script

sys.path.insert(0, str(ROOT / "scripts" / "checks"))
import parity_matrix as pm  # noqa: E402

SCRIPT = "l12_smoke.py"
TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def scripts_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as when the smoke runs: it imports l11_smoke


def run(argv: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(ROOT / "scripts" / SCRIPT), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def no_args() -> subprocess.CompletedProcess:
    """`python scripts/l12_smoke.py` as docs/l12_kv_quant.md runs it (one thread, CUDA hidden, 200 columns): the doc
    tests, earlier in the suite, have made this very run, memoised for the session, so it is not made twice."""
    from test_doc_claims import run_doc_command

    return run_doc_command("python scripts/l12_smoke.py")


@pytest.fixture(scope="module")
def auto() -> subprocess.CompletedProcess:
    return run(["--kv-dtype", "auto", "--max-new-tokens", "8"])


def test_no_arguments_is_int8_and_the_contract_holds(no_args):
    assert no_args.returncode == 0, no_args.stdout[-3000:] + no_args.stderr[-3000:]
    out = no_args.stdout
    assert "kv-dtype int8" in out and "vs HF" not in out  # no HF reference: exact tokens are not int8's test
    # Both quality lines, over the 1,000+ positions the contract is stated over, and both verdicts.
    quality = re.findall(r"^(int8 KV|bf16 model) +: KL mean [\d.e-]+, p99 [\d.e-]+, p99\.9 [\d.e-]+, top-1 agreement "
                         r"[\d.]+% over ([\d,]+) positions", out, re.M)
    assert [name for name, _ in quality] == ["int8 KV", "bf16 model"], out
    assert all(int(n.replace(",", "")) >= 1000 for _, n in quality)
    assert re.search(r"^PASS: int8 KV moves the next-token distributions no more than bf16 compute does", out, re.M)
    # the judgement: each judged measure with its paired interval and verdict; no tail judged at this size
    verdicts = re.search(r"^int8 against bf16, paired.*$", out, re.M).group(0)
    judged = re.findall(r"(mean KL|p99 KL|top-1 agreement) [^;]*\[[-+\d., ]+\] (holds|fails|unresolved)", verdicts)
    assert judged == [("mean KL", "holds"), ("top-1 agreement", "holds")], out
    assert "no tail judged: 1,021 positions leave 10.2 beyond p99 (needs 50)" in out, out
    free, usable = map(int, re.search(r"^PASS: ([\d,]+) of ([\d,]+) usable blocks free", out, re.M).groups())
    assert free == usable
    assert re.search(r"^worst int8 position: prompt \d+ position \d+ .*fp32 KV's top token \d+ .*int8's \d+", out, re.M)


def test_no_arguments_prints_more_int8_blocks_than_bf16_in_the_same_bytes(no_args):
    line = re.search(r"^pool: ([\d,]+) bytes .*$", no_args.stdout, re.M)
    assert line, no_args.stdout[-3000:]
    number = {name: int(m.replace(",", "")) for name, m in
              re.findall(r"\b(int8|bf16|fp32) ([\d,]+) \(", line.group(0))}
    assert number["int8"] > number["bf16"] > number["fp32"] > 0, line.group(0)
    # The default budget is L11's default pool in the model's dtype (fp32 here): its own 4096 tokens' blocks.
    assert number["fp32"] == 4096 // 16 and int(line.group(1).replace(",", "")) == 256 * number["fp32"] * 256
    ratio = float(re.search(r"([\d.]+)x bf16's blocks", line.group(0)).group(1))
    assert ratio == pytest.approx(number["int8"] / number["bf16"], abs=0.01) and 1.8 < ratio < 2


def test_kv_dtype_auto_is_l11s_smoke_with_hf_parity(auto):
    assert auto.returncode == 0, auto.stdout[-3000:] + auto.stderr[-3000:]
    out = " ".join(auto.stdout.split())
    assert "PASS: every prompt matches HF" in out
    assert "L12 vs HF: identical" in out and "L11 vs HF: identical" in out
    assert "PASS: L12, kv-dtype auto:" in out and "(L11 runs the same class)" in out and "(LEAK)" not in out


@pytest.mark.parametrize("argv,message", [
    (["--kv-dtype", "int4"], "error: argument --kv-dtype: invalid choice: 'int4'"),
    (["--kv-bytes", "0"], "error: argument --kv-bytes: 0 is below 1 byte"),
    (["--kv-bytes", "x"], "error: argument --kv-bytes: 'x' is not a whole number of bytes"),
    (["--kv-bytes", "1.5e6"], "error: argument --kv-bytes: '1.5e6' is not a whole number of bytes"),
    (["--kv-bytes", "100000", "--num-blocks", "4"], "error: give --kv-bytes or --num-blocks, not both"),
    (["--kv-dtype", "auto", "--kv-bytes", "100000", "--num-blocks", "4"], "error: give --kv-bytes or --num-blocks"),
    (["--kv-bytes", "1000"], "error: kv-bytes 1000 holds no block of 16 tokens"),  # after the model loads
    (["--num-speculative-tokens", "-1"], "error: argument --num-speculative-tokens: -1 is below 0"),
])
def test_bad_values_are_one_line_exit_2(argv, message, capsys):
    code, out, err = run_script(SCRIPT, argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(message), lines


def made_up(kl: float, top1: float, worst: Worst, n: int = 5000) -> Quality:
    """A Quality from made-up figures: every position's KL the same, top-1 agreement in the first top1 * n."""
    kls = torch.full((n,), kl, dtype=torch.float64)
    agree = torch.arange(n) < round(top1 * n)
    return Quality(positions=n, mean_kl=kl, p999_kl=kl, top1=top1, worst=worst, kl=kls, agree=agree,
                   stream_lengths=(n // 2, n - n // 2))


def test_a_failing_contract_names_the_worst_position_and_both_top_tokens(tokenizer):
    """The FAIL line, from made-up figures: which measures broke and how, where, and both sides' top tokens."""
    smoke = importlib.import_module("l12_smoke")
    setup = SimpleNamespace(tokenizer=tokenizer, prompt_ids=[[1, 2, 3], [4, 5]])
    worst = Worst(stream=1, position=3, kl=2.5, ref_top=tokenizer.encode(" cat").ids[0],
                  test_top=tokenizer.encode(" dog").ids[0])
    test, yardstick = made_up(0.06, 0.95, worst), made_up(0.04, 0.90, Worst(0, 0, 1.0, 0, 0))
    line = smoke.contract_line("int8", judge(test, yardstick), test, setup)
    assert line.startswith("int8 KV is not shown within the bf16 yardstick's margins on mean KL (fails), "
                           "p99 KL (fails);"), line
    assert "prompt 1 position 3 (in its continuation), KL 2.5" in line
    assert "fp32 KV's top token" in line and "' cat'" in line and "int8's" in line and "' dog'" in line
    tied = smoke.contract_line("int8", judge(yardstick, yardstick), yardstick, setup)
    assert tied.startswith("int8 KV moves"), tied  # equal runs are within every margin


def test_the_parity_matrix_checks_l12_with_kv_dtype_auto():
    """int8 has no HF parity: the matrix's L12 row is --kv-dtype auto (L11's engine), at the largest block size."""
    l12 = ROOT / "scripts" / SCRIPT
    cells = pm.grid({l12: True}, ["float32", "bfloat16"], ["default", "unicode"], [1, 7, 16])
    assert len(cells) == 4 and {c.block_size for c in cells} == {16}
    assert all(c.argv(20, None)[c.argv(20, None).index("--kv-dtype") + 1] == "auto" for c in cells)
    help_text = "--block-size BLOCK_SIZE  tokens per KV block (default: 16)"
    assert pm.no_arg_cell(l12, help_text, on_cuda=False) not in cells  # the int8 no-argument run is another run

"""L16's parity cells: the matrix runs its smoke with --weights q4_1 --parity, in fp32 only, at the largest block
size; --parity on a model quantized here has HF read the dequantized weights from a checkpoint written once into
the course cache (lessons/l16_weight_quant/reference.py), keyed by the source checkpoint and the format."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lessons.l16_weight_quant.reference import dequantized_checkpoint  # noqa: E402
from lessons.l16_weight_quant.weights import dequantized_model, quantized_model  # noqa: E402
from scripts.checks import parity_matrix as pm  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402

CPU = torch.device("cpu")


def test_l16_runs_q4_1_with_parity_in_fp32_only_at_the_largest_block_size():
    l16 = ROOT / "scripts" / "l16_smoke.py"
    cells = pm.grid({l16: True}, ["float32", "bfloat16"], pm.DEFAULT_PROMPT_SETS, [1, 7, 16])
    assert sorted((c.dtype, c.prompts, c.block_size) for c in cells) == [("float32", "default", 16),
                                                                        ("float32", "unicode", 16)]
    argv = cells[0].argv(20, None)
    assert argv[argv.index("--weights") + 1] == "q4_1" and "--parity" in argv
    assert pm.grid({l16: True}, ["bfloat16"], ["default"], [16]) == []  # CI's bf16 matrix has no L16 cell
    # the no-argument run (the quality contract) is not a parity cell: --skip-no-arg-runs leaves none of these out
    assert pm.no_arg_cell(l16, "--block-size BLOCK_SIZE  tokens per KV block (default: 16)", False) not in cells


def test_parity_needs_a_format_quantized_here():
    r = subprocess.run([sys.executable, "scripts/l16_smoke.py", "--weights", "fp32", "--parity"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "error: --parity needs --weights q8_0 or q4_1 (the formats quantized here), not fp32\n"


def test_the_reference_checkpoint_holds_the_dequantized_weights_and_is_made_once(tiny_dir, tiny_model, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setenv("PAGED_COURSE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / tiny_dir.name
    shutil.copytree(tiny_dir, source)
    made = dequantized_checkpoint(source, "q4_1")
    assert made.is_relative_to(tmp_path / "cache") and {p.name for p in source.iterdir()} == {
        p.name for p in made.iterdir()}
    loaded = Qwen3ForCausalLM.from_dir(made, torch.float32, CPU).state_dict()
    expected = dequantized_model(quantized_model(tiny_model, "q4_1")).state_dict()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name
    stamp = (made / "model.safetensors").stat().st_mtime_ns
    assert dequantized_checkpoint(source, "q4_1") == made  # reused, not rewritten
    assert (made / "model.safetensors").stat().st_mtime_ns == stamp
    assert dequantized_checkpoint(source, "q8_0") != made  # keyed by the format
    weights = source / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    assert dequantized_checkpoint(source, "q4_1") != made  # and by the source: an edited checkpoint gets a new one
    assert not [p for p in made.parent.iterdir() if ".tmp-" in p.name]  # no staging folder left behind

"""Backend selection, and the smoke script's contract: --backend, exit statuses, --json."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lessons.l3_block_tensor.backends import BatchedBackend, TorchBackend, make_backend
from lessons.l3_block_tensor.backends.flashinfer_args import unsupported_reason, use_tensor_cores
from shared.errors import CourseError

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def smoke(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/l3_smoke.py", *args], cwd=ROOT, capture_output=True, text=True)


def test_backends_by_name_on_cpu(tiny_model):
    # auto's choice on the CPU (the C++ kernel, or batched where it cannot build): tests/test_l3_cpp_backend.py
    cfg = tiny_model.config
    assert isinstance(make_backend("batched", cfg, torch.float32, CPU), BatchedBackend)
    assert isinstance(make_backend("torch", cfg, torch.float32, CPU), TorchBackend)


def test_flashinfer_where_it_cannot_run_is_a_course_error(tiny_model):
    with pytest.raises(CourseError, match="needs a CUDA device; this run is on cpu"):
        make_backend("flashinfer", tiny_model.config, torch.bfloat16, CPU)
    with pytest.raises(CourseError, match="unknown backend 'flash'"):
        make_backend("flash", tiny_model.config, torch.float32, CPU)


def test_reasons_flashinfer_cannot_run(tiny_model):
    cfg, cuda = tiny_model.config, torch.device("cuda")  # a device object needs no GPU
    assert unsupported_reason(cfg, torch.bfloat16, CPU) is not None
    if importlib.util.find_spec("flashinfer") is None:
        assert "not installed" in unsupported_reason(cfg, torch.bfloat16, cuda)
        return
    assert unsupported_reason(cfg, torch.bfloat16, cuda) is None
    assert "float32" in unsupported_reason(cfg, torch.float32, cuda)
    assert "head_dim 96" in unsupported_reason(replace(cfg, head_dim=96), torch.bfloat16, cuda)


@pytest.mark.parametrize("hq,hkv,want", [(4, 2, False), (32, 8, True), (40, 8, True), (12, 4, False), (16, 2, True)])
def test_tensor_cores_for_wide_groups(tiny_model, hq, hkv, want):
    assert use_tensor_cores(replace(tiny_model.config, num_attention_heads=hq, num_key_value_heads=hkv)) == want


def test_smoke_backend_flashinfer_on_cpu_is_one_line_exit_2():
    if torch.cuda.is_available():
        pytest.skip("this machine can run FlashInfer")
    r = smoke("--backend", "flashinfer", "--max-new-tokens", "2")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: --backend flashinfer")
    assert "Traceback" not in r.stderr


def test_smoke_unknown_backend_exit_2():
    r = smoke("--backend", "nonsense")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "nonsense" in r.stderr


def test_smoke_default_batch_json():
    r = smoke("--json", "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    lengths = [len(p["prompt_ids"]) for p in report["prompts"]]
    assert len(lengths) >= 4 and len(set(lengths)) == len(lengths) and min(lengths) == 1
    assert report["match"] and all(p["L3"] == p["hf"] == p["L2"] for p in report["prompts"])

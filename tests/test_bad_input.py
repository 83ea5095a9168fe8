"""Every bad input to the L1/L2 smoke scripts: exit status 2, one line on stderr naming the value, no traceback."""
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lessons.l2_token_flat import L2Engine
from shared.errors import CourseError
from shared.generation import StopRule

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """Run scripts/<script> as __main__ in this process (the model stays warm in the OS cache)."""
    old = sys.argv
    sys.argv = [script, *argv]
    try:
        runpy.run_path(str(ROOT / "scripts" / script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def broken_dirs(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("broken")
    (root / "empty").mkdir()
    (root / "no_weights").mkdir()
    (root / "no_weights" / "config.json").write_text((tiny_dir / "config.json").read_text())
    (root / "mistral").mkdir()
    cfg = json.loads((tiny_dir / "config.json").read_text()) | {"model_type": "mistral"}
    (root / "mistral" / "config.json").write_text(json.dumps(cfg))
    (root / "a_file").write_text("not a directory")
    return root


CASES = {
    "missing dir": (["--model", "/no/such/model/dir"], "/no/such/model/dir"),
    "empty dir": (["--model", "{broken}/empty"], "no config.json"),
    "no weights": (["--model", "{broken}/no_weights"], "no *.safetensors"),
    "not qwen3 or llama": (["--model", "{broken}/mistral"], "'mistral': the course runs qwen3 and llama"),
    "model is a file": (["--model", "{broken}/a_file"], "not a directory"),
    "empty prompt": (["--prompt", ""], "empty prompt"),
    "over model context": (["--max-new-tokens", "5000"], "exceeds the model's context of 4096"),
    "over pool": (["--block-size", "4", "--num-blocks", "2", "--max-new-tokens", "20"], "needs 6 blocks of 4 tokens; the pool has 2"),
    "zero new tokens": (["--max-new-tokens", "0"], "max-new-tokens must be at least 1, got 0"),
    "non-integer new tokens": (["--max-new-tokens", "lots"], "'lots'"),
    "zero block size": (["--block-size", "0"], "block-size must be at least 1, got 0"),
    "zero blocks": (["--num-blocks", "0"], "num-blocks must be at least 1, got 0"),
    "unknown device": (["--device", "tpu"], "unknown device 'tpu'"),
    "unknown dtype": (["--dtype", "float64"], "unknown dtype 'float64'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_l2_smoke_rejects(case, broken_dirs, capsys):
    argv, needle = CASES[case]
    argv = [a.format(broken=broken_dirs) for a in argv]
    code, out, err = run_script("l2_smoke.py", argv, capsys)
    assert code == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu(capsys):
    code, out, err = run_script("l2_smoke.py", ["--device", "cuda"], capsys)
    assert code == 2 and "no CUDA GPU" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--max-new-tokens", "0"], ["--model", "/no/such/dir"], ["--prompt", ""]])
def test_l1_smoke_rejects(argv, capsys):
    code, out, err = run_script("l1_smoke.py", argv, capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("script", ["l1_smoke.py", "l2_smoke.py"])
def test_end_to_end_exit_status_and_no_traceback(script, broken_dirs):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--model", str(broken_dirs / "mistral")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_engine_rejects_what_the_pool_cannot_hold_and_stays_whole(tiny_model):
    engine = L2Engine(tiny_model, block_size=4, num_blocks=3)
    with pytest.raises(CourseError, match="needs 5 blocks of 4 tokens; the pool has 3"):
        engine.generate(list(range(10, 20)), StopRule(10))
    assert engine.allocator.num_free == 3
    assert len(engine.generate(list(range(10, 15)), StopRule(5, ignore_eos=True))) == 5  # still serving
    assert engine.allocator.num_free == 3


def test_engine_frees_blocks_when_a_step_fails(tiny_model, monkeypatch):
    engine = L2Engine(tiny_model, block_size=4, num_blocks=8)

    def boom(*a, **k):
        raise RuntimeError("kernel failure")

    monkeypatch.setattr(engine.pool, "attend", boom)
    with pytest.raises(RuntimeError):
        engine.generate([1, 2, 3, 4, 5, 6], StopRule(4))
    assert engine.allocator.num_free == 8

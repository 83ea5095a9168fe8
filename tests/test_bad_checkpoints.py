"""Malformed checkpoints: one line on stderr naming the file and the fault, exit status 2, no traceback."""
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_bad_input import ROOT, run_script


def _config(**edit) -> Callable[[Path], None]:
    """Set fields of config.json; None deletes one."""
    def apply(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text()) | edit
        (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return apply


def _write(name: str, text: str | bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(text.encode() if isinstance(text, str) else text)


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _sharded(index: str) -> Callable[[Path], None]:
    return lambda d: (d / "model.safetensors.index.json").write_text(index)


def _reshape_one(d: Path) -> None:
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(10, 128)
    save_file(state, str(d / "model.safetensors"))


# (how to break a copy of the tiny model, what the one error line must contain)
CASES = {
    "config not json": (_write("config.json", "{not json"), ["config.json", "not valid JSON"]),
    "config a list": (_write("config.json", "[1, 2]"), ["config.json", "JSON list, not an object"]),
    "no hidden_size": (_config(hidden_size=None), ["config.json", "no hidden_size"]),
    "no vocab_size": (_config(vocab_size=None), ["config.json", "no vocab_size"]),
    "string layers": (_config(num_hidden_layers="4"), ["config.json", "num_hidden_layers must be a positive int, got '4'"]),
    "zero heads": (_config(num_attention_heads=0), ["config.json", "num_attention_heads must be a positive int, got 0"]),
    "negative ffn": (_config(intermediate_size=-1), ["config.json", "intermediate_size must be a positive int, got -1"]),
    "heads % kv": (_config(num_key_value_heads=3), ["config.json", "4 is not divisible by num_key_value_heads 3"]),
    "truncated weights": (_truncate, ["model.safetensors", "not a readable safetensors file"]),
    "garbage weights": (_write("model.safetensors", b"\x00garbage" * 64), ["model.safetensors", "not a readable"]),
    "index not json": (_sharded("{"), ["model.safetensors.index.json", "not valid JSON"]),
    "index no weight_map": (_sharded("{}"), ["model.safetensors.index.json", "no weight_map"]),
    "config hidden edited": (_config(hidden_size=256),
                             ["model.safetensors", "model.embed_tokens.weight has shape [151936, 128]", "[151936, 256]"]),
    "one tensor reshaped": (_reshape_one, ["model.safetensors", "layers.1.mlp.up_proj.weight has shape [10, 128]", "[384, 128]"]),
    "tokenizer not json": (_write("tokenizer.json", "{oops"), ["tokenizer.json", "not a valid tokenizer"]),
    "tokenizer wrong json": (_write("tokenizer.json", '{"a": 1}'), ["tokenizer.json", "not a valid tokenizer"]),
    "generation config not json": (_write("generation_config.json", "nope"), ["generation_config.json", "not valid JSON"]),
}


@pytest.fixture
def broken(tmp_path, tiny_dir) -> Callable[[str], Path]:
    def make(case: str) -> Path:
        d = tmp_path / "model"
        shutil.copytree(tiny_dir, d)
        CASES[case][0](d)
        return d
    return make


@pytest.mark.parametrize("case", list(CASES))
def test_l2_smoke_rejects_broken_checkpoint(case, broken, capsys):
    code, out, err = run_script("l2_smoke.py", ["--model", str(broken(case)), "--max-new-tokens", "2"], capsys)
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in CASES[case][1]:
        assert needle in lines[0]


def test_end_to_end_no_traceback(broken):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "l1_smoke.py"), "--model", str(broken("one tensor reshaped"))],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "up_proj" in proc.stderr

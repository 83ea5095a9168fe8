"""Weights from *.safetensors: one file, or shards listed in model.safetensors.index.json."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from shared.errors import CourseError


def weight_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise CourseError(f"{model_dir}: shard {missing[0]} named in the index is missing")
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CourseError(f"no *.safetensors weights in model directory {model_dir}")
    return files


def load_state_dict(model_dir: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor in the checkpoint, cast to `dtype` on `device`, keyed by its HF name."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return state

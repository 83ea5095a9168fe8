"""Weights from *.safetensors: one file, or shards listed in model.safetensors.index.json."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from shared.config import read_json_object
from shared.errors import CourseError

Shapes = dict[str, tuple[tuple[int, ...], Path]]


def weight_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CourseError(f"{index} has no weight_map object of tensor name -> shard file")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise CourseError(f"{model_dir}: shard {missing[0]} named in the index is missing")
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CourseError(f"no *.safetensors weights in model directory {model_dir}")
    return files


def tensor_shapes(model_dir: Path) -> Shapes:
    """Every tensor's shape and file, from the headers alone: a corrupt file fails here, before any loading."""
    shapes: Shapes = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = (tuple(f.get_slice(name).get_shape()), path)
        except (SafetensorError, OSError) as e:
            raise CourseError(f"{path} is not a readable safetensors file: {_first_line(e)}") from None
    return shapes


# name -> (dim, start, stop): read only that range of the tensor (a tensor-parallel rank's part); None: all of it
SliceOf = Callable[[str], "tuple[int, int, int] | None"]


def load_state_dict(model_dir: Path, dtype: torch.dtype, device: torch.device,
                    slice_of: SliceOf = lambda name: None) -> dict[str, torch.Tensor]:
    """Every tensor in the checkpoint (or the part `slice_of` names), cast to `dtype` on `device`, by HF name."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    part = slice_of(name)
                    if part is None:
                        tensor = f.get_tensor(name)
                    else:  # safetensors reads just these rows (or columns) from the file
                        dim, start, stop = part
                        rows = f.get_slice(name)
                        tensor = rows[start:stop] if dim == 0 else rows[:, start:stop]
                    state[name] = tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise CourseError(f"{path} is not a readable safetensors file: {_first_line(e)}") from None
    return state


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__

"""HF's reference for weights quantized here: the dequantized model written once as an ordinary HF checkpoint into
the course cache, so HF, and every earlier lesson's engine, runs exactly the values the blocks hold. A shipped file
needs none (SmolLM2's converted checkpoint is its Q4_1 file dequantized); a model quantized from full precision
does, for the parity matrix's L16 cells (`l16_smoke.py --weights q4_1 --parity`).

The folder is keyed by the source checkpoint (its path and its files' names, sizes and modification times) and the
format, so a rebuilt or edited checkpoint gets a new one; REFERENCE_VERSION names the quantizer's version.
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from lessons.l16_weight_quant.weights import dequantized_model, quantized_model
from shared.checkpoint import tensor_shapes
from shared.model import Qwen3ForCausalLM
from shared.tiny_qwen3 import cache_root

REFERENCE_VERSION = 1  # bump when blocks.quantize or dequantize changes what they compute


def source_key(model_dir: Path) -> str:
    """A short digest of which checkpoint this is: its resolved path and each file's name, size and mtime."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        stat = path.stat()
        h.update(f"\0{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def dequantized_checkpoint(model_dir: Path, fmt: str) -> Path:
    """The checkpoint of `model_dir` quantized to `fmt` and dequantized back to fp32, in the cache: made on first
    use (written beside and renamed into place, so a killed run leaves nothing that looks finished), then reused.
    Every file but the weights (config, tokenizer, chat template) is the source's own."""
    out = cache_root() / "l16-dequantized" / f"{model_dir.name}-{fmt}-{source_key(model_dir)}-v{REFERENCE_VERSION}"
    if (out / "model.safetensors").is_file():
        return out
    names = tensor_shapes(model_dir)  # the source's own tensor names: a tied head is written only if it was there
    dense = dequantized_model(quantized_model(Qwen3ForCausalLM.from_dir(model_dir, torch.float32,
                                                                      torch.device("cpu")), fmt)).state_dict()
    # clone: a tied head shares the embedding's tensor, and safetensors refuses shared storage
    weights = {name: dense[name].detach().clone().contiguous() for name in names if name in dense}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        for path in model_dir.iterdir():
            if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
                shutil.copy2(path, staging / path.name)
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        try:
            staging.rename(out)  # atomic: a concurrent writer either wins or finds the folder there
        except OSError:
            if not (out / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out

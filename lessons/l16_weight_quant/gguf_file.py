"""A GGUF file's tensors as shipped: quantized ones stay blocks of bytes, named as the course's model names them.

`gguf.GGUFReader` maps the file and hands each tensor's bytes as a numpy view; a quantized [N, K] tensor is N rows
of blocks. Two things differ from an HF checkpoint. The names (llama.cpp's `blk.3.ffn_up.weight` is HF's
`model.layers.3.mlp.up_proj.weight`). And a Llama file's q and k rows: llama.cpp's converter permutes them
(within each head it interleaves the two halves that HF's RoPE rotates together), so reading a Llama file undoes
it, as transformers does when it loads one. A permutation of rows moves whole rows of blocks: no weight is
dequantized to do it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.config import Qwen3Config
from shared.errors import CourseError

LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True)
class FileTensor:
    """One tensor: fp32 values (norms), or uint8 blocks [N, bytes] in `fmt` for a matrix [N, K]."""

    fmt: str  # "f32", "q8_0", "q4_1"
    data: torch.Tensor
    k: int  # the row length in weights (the file lists shapes innermost first)


def hf_name(name: str) -> str | None:
    if m := BLK.match(name):
        part = LAYER.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.weight"
    base = name.removesuffix(".weight")
    return f"{GLOBAL[base]}.weight" if base in GLOBAL and name.endswith(".weight") else None


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation on the rows (of values or of blocks): within each head, rows were
    reordered as (half, pair) -> (pair, half); this puts them back."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# Task L16.2: the shipped file's tensors by the model's names, blocks kept as bytes, Llama's q/k rows put back
def read_gguf(path: Path, cfg: Qwen3Config) -> dict[str, FileTensor]:
    """Every tensor the model uses, by HF name. Raises CourseError naming a tensor whose type is not read here."""
    import gguf

    types = {gguf.GGMLQuantizationType.F32: "f32", gguf.GGMLQuantizationType.Q8_0: "q8_0",
             gguf.GGMLQuantizationType.Q4_1: "q4_1"}
    reader = gguf.GGUFReader(str(path))
    out: dict[str, FileTensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        fmt = types.get(t.tensor_type)
        if fmt is None:
            raise CourseError(f"{path.name}: {t.name} is {t.tensor_type.name}; this lesson reads F32, Q8_0 and Q4_1")
        rows = np.asarray(t.data)
        # a Llama file (no q/k norms: shared/config.py); llama.cpp permutes no Qwen3 rows
        if not cfg.qk_norm and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            rows = unpermute_rows(rows, heads)
        data = torch.from_numpy(np.array(rows))  # a copy: the file's bytes, out of the read-only map
        out[name] = FileTensor(fmt, data, int(t.shape[0]))
    return out

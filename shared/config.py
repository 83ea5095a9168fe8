"""Qwen3 hyper-parameters, read from a HuggingFace config.json (and generation_config.json for EOS)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.errors import CourseError


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @property
    def gqa_ratio(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer: 2 x H_kv x D x layers x bytes."""
        return 2 * self.num_key_value_heads * self.head_dim * self.num_hidden_layers * dtype_bytes

    @classmethod
    def from_dir(cls, model_dir: Path) -> "Qwen3Config":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CourseError(f"no config.json in model directory {model_dir}")
        raw = json.loads(path.read_text())
        if raw.get("model_type") != "qwen3":
            raise CourseError(f"{model_dir} holds model_type {raw.get('model_type')!r}, not a qwen3 checkpoint")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CourseError(f"{model_dir}: rope type {rope.get('rope_type')!r} is not supported, only default RoPE")
        theta = raw.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise CourseError(f"{model_dir}/config.json has no rope_theta")
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(Path(model_dir), raw),
        )


def _eos_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    """generation_config.json wins over config.json, as in HF generate."""
    eos = raw.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)

"""Model hyper-parameters, read from a HuggingFace config.json (and generation_config.json for EOS).

Two architectures, told apart by the config's model_type: Qwen3, and Llama (SmolLM2 is one), which is Qwen3
without the per-head q/k RMSNorms. Everything else the course reads is the same in both.
"""
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
    qk_norm: bool = True  # Qwen3's per-head RMSNorm on q and k; Llama has none

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
        raw = read_json_object(path)
        kind = raw.get("model_type")
        if kind not in ARCHITECTURES:
            raise CourseError(f"{model_dir} holds model_type {kind!r}: the course runs {' and '.join(ARCHITECTURES)} "
                              f"checkpoints")
        for flag in ("attention_bias", "mlp_bias"):  # Llama's options the course's layers do not have
            if raw.get(flag):
                raise CourseError(f"{path}: {flag} true is not supported (the course's projections have no bias)")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
            kind = rope.get("rope_type") if isinstance(rope, dict) else rope
            raise CourseError(f"{model_dir}: rope type {kind!r} is not supported, only default RoPE")
        theta = raw.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise CourseError(f"{path} has no rope_theta")
        # Checked here, one field at a time, so a hand-edited config fails with its name, not deep in torch.
        ints = {k: _positive(path, k, raw.get(k), int) for k in REQUIRED}
        heads = ints["num_attention_heads"]
        kv_heads = _positive(path, "num_key_value_heads", raw.get("num_key_value_heads", heads), int)
        if heads % kv_heads:
            raise CourseError(f"{path}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}")
        head_dim = raw.get("head_dim") or ints["hidden_size"] // heads
        return cls(
            **ints,
            num_key_value_heads=kv_heads,
            head_dim=_positive(path, "head_dim", head_dim, int),
            rms_norm_eps=_positive(path, "rms_norm_eps", raw.get("rms_norm_eps", 1e-6), float),
            rope_theta=_positive(path, "rope_theta", theta, float),
            max_position_embeddings=_positive(path, "max_position_embeddings", raw.get("max_position_embeddings", 32768),
                                              int),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(Path(model_dir), raw),
            qk_norm=ARCHITECTURES[kind],
        )


ARCHITECTURES = {"qwen3": True, "llama": False}  # model_type -> whether attention has per-head q/k norms

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_json_object(path: Path) -> dict:
    """A JSON object from `path`, or a one-line CourseError naming the file."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CourseError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CourseError(f"{path} holds a JSON {type(raw).__name__}, not an object")
    return raw


def _positive(path: Path, key: str, value: object, kind: type) -> int | float:
    # bool is an int subclass, and `true` as a layer count is an edit gone wrong.
    ok_types = (int,) if kind is int else (int, float)
    if value is None:
        raise CourseError(f"{path} has no {key}")
    if isinstance(value, bool) or not isinstance(value, ok_types) or not value > 0:
        raise CourseError(f"{path}: {key} must be a positive {kind.__name__}, got {value!r}")
    return kind(value)


def _eos_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    """generation_config.json wins over config.json, as in HF generate."""
    eos = raw.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = read_json_object(gen_path).get("eos_token_id", eos)
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CourseError(f"{model_dir}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    return tuple(ids)

"""The embedded default model: a tiny Qwen3 built deterministically, in HuggingFace format, into a cache.

Random weights would make a lazy model: with tied embeddings the residual stream mostly carries the
current token, so greedy decoding repeats it forever and ignores the KV cache. The scales below
avoid that, so a KV bug shows up in the tokens:
  * the final norm's gain is a random +-1 per channel, so a token's embedding no longer predicts itself;
  * q_norm / k_norm gains around QK_GAIN sharpen attention, so single cached keys matter;
  * projections are scaled to keep each sub-layer's output the size of the residual stream.
Every norm gain except the final norm's is drawn per channel (input / post-attention around 1, q / k
around QK_GAIN, each spread by NORM_SPREAD), different in every layer and norm: a norm applied to the
wrong tensor, or one layer's norm used in another, then changes the tokens instead of multiplying by
the same constant.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.tokenizer import build_qwen3_tokenizer

BUILD_VERSION = 3  # bump whenever the bytes below change; it names the cache folder
SEED = 20260101
QK_GAIN = 2.0
NORM_SPREAD = 0.4  # each norm gain is its centre times a uniform factor in [1 - spread, 1 + spread]
IM_END, ENDOFTEXT = 151645, 151643

TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "bos_token_id": ENDOFTEXT,
    "eos_token_id": IM_END,
    "torch_dtype": "float32",
}
GENERATION_CONFIG = {"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT], "do_sample": False}
TOKENIZER_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "add_bos_token": False,
    "model_max_length": TINY_CONFIG["max_position_embeddings"],
    # ChatML, the turn format Qwen's chat models use (without Qwen3's tool and thinking extras): with it both
    # L9's server and HF's `transformers serve` answer chat completions offline on the embedded model.
    "chat_template": (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tiny_weights(cfg: dict, seed: int = SEED) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    def gains(n: int, centre: float) -> torch.Tensor:
        # Positive and bounded: no channel flips sign or vanishes, so the scales above still hold on average.
        return centre * (1 + NORM_SPREAD * (2 * torch.rand(n, generator=g, dtype=torch.float32) - 1))

    e, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = {"model.embed_tokens.weight": normal(cfg["vocab_size"], e, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(hq * d, e, std=e**-0.5)
        w[p + "self_attn.k_proj.weight"] = normal(hkv * d, e, std=e**-0.5)
        w[p + "self_attn.v_proj.weight"] = normal(hkv * d, e, std=e**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(e, hq * d, std=(hq * d) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = normal(f, e, std=e**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(f, e, std=e**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(e, f, std=f**-0.5)
    w["model.norm.weight"] = torch.randint(0, 2, (e,), generator=g).float() * 2 - 1
    # Drawn last, from the same generator, so the projections and embeddings above keep their values.
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = gains(e, 1.0)
        w[p + "post_attention_layernorm.weight"] = gains(e, 1.0)
        w[p + "self_attn.q_norm.weight"] = gains(d, QK_GAIN)
        w[p + "self_attn.k_norm.weight"] = gains(d, QK_GAIN)
    return w


def write_tokenizer(out: Path) -> None:
    build_qwen3_tokenizer().save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", TOKENIZER_CONFIG)


def build_tiny_qwen3(out: Path) -> Path:
    """Write config, generation config, weights and tokenizer to `out`. Same bytes on every build."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", TINY_CONFIG)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    save_file(tiny_weights(TINY_CONFIG), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out)
    return out


def cache_root() -> Path:
    """$PAGED_COURSE_CACHE, else $XDG_CACHE_HOME/paged-attention-course, else ~/.cache/paged-attention-course."""
    if env := os.environ.get("PAGED_COURSE_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "paged-attention-course"


def default_model_dir() -> Path:
    """The tiny model's cache folder, built on first use (about 5 s) and reused after."""
    target = cache_root() / f"tiny-qwen3-v{BUILD_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="tiny-qwen3-", dir=target.parent))
    try:
        build_tiny_qwen3(staging)
        try:
            staging.rename(target)  # atomic: a concurrent builder either wins or finds the folder there
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def checkpoint_digest(model_dir: Path) -> str:
    """sha256 over the files of a checkpoint, in name order: the determinism check."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

"""Qwen3 over a flat token stream. The attention layer hands q, k, v to a lesson-supplied KV object.
A Llama checkpoint (config model_type "llama") runs through the same classes: it is Qwen3 without q_norm/k_norm.

Shapes (no batch dimension; several requests are simply concatenated):
  T tokens in the step, Hq query heads, Hkv key/value heads, D head_dim, E hidden size.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from shared.checkpoint import load_state_dict, tensor_shapes
from shared.config import Qwen3Config
from shared.errors import CourseError
from shared.layers import MLP, Linear, RMSNorm, RotaryEmbedding


RopeTables = tuple[torch.Tensor, torch.Tensor]  # one step's cos and signed sin, [T, 1, D] each (RotaryEmbedding.tables)


class KvAttention(Protocol):
    """The seam every lesson fills: store this step's k, v and attend q over the request's history.

    q [T, Hq, D], k and v [T, Hkv, D] (post-norm, post-RoPE); `meta` is the lesson's per-step metadata,
    built once per step and shared by every layer. Returns [T, Hq, D].
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor: ...


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer: int):
        super().__init__()
        self.layer, self.hq, self.hkv, self.d = layer, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.hq * self.d)
        self.k_proj = Linear(cfg.hidden_size, self.hkv * self.d)
        self.v_proj = Linear(cfg.hidden_size, self.hkv * self.d)
        self.o_proj = Linear(self.hq * self.d, cfg.hidden_size)
        if cfg.qk_norm:  # per-head norms: Qwen3's addition over Qwen2 and Llama
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x: torch.Tensor, rope_tables: RopeTables, rope: RotaryEmbedding, kv: KvAttention,
                meta: Any) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.hq, self.d))
        k = self.k_norm(self.k_proj(x).view(t, self.hkv, self.d))
        v = self.v_proj(x).view(t, self.hkv, self.d)
        q, k = rope(q, k, rope_tables)  # the cache stores keys after RoPE
        out = kv.attend(self.layer, q, k, v, meta)
        return self.o_proj(out.reshape(t, self.hq * self.d))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope_tables: RopeTables, rope: RotaryEmbedding, kv: KvAttention,
                meta: Any) -> torch.Tensor:
        # x is this step's own residual stream (the embedding's fresh output, then these sums): added to in place.
        x.add_(self.self_attn(self.input_layernorm(x), rope_tables, rope, kv, meta))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class Qwen3Body(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)


class Qwen3ForCausalLM(nn.Module):
    """Parameter names match HF's, so a checkpoint's state dict loads as is."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.config = cfg
        self.model = Qwen3Body(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KvAttention, meta: Any) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, E]. Call `logits` on the rows you need."""
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary
        rope_tables = rope.tables(positions, x.dtype)  # cos and sin depend on positions only: once per step
        for layer in self.model.layers:
            x = layer(x, rope_tables, rope, kv, meta)
        return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, E] -> fp32 logits [N, vocab]. Only sampled rows pay for the vocab projection."""
        return self.lm_head(hidden).float()

    @classmethod
    def from_dir(cls, model_dir: Path, dtype: torch.dtype, device: torch.device) -> "Qwen3ForCausalLM":
        cfg = Qwen3Config.from_dir(model_dir)
        with torch.device("meta"):
            model = cls(cfg)
        check_shapes(model, cfg, model_dir)  # headers only: no tensor data is read for a bad checkpoint
        state = load_state_dict(model_dir, dtype, device)
        if cfg.tie_word_embeddings or "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        expected = set(model.state_dict())
        model.load_state_dict({k: state[k] for k in expected}, assign=True, strict=True)
        # inv_freq is a computed buffer, not a checkpoint tensor: rebuild it off the meta device.
        model.model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(device)
        return model.eval()


def check_shapes(model: nn.Module, cfg: Qwen3Config, model_dir: Path) -> None:
    """Name the first missing or mis-shaped tensor; load_state_dict would raise a multi-line error."""
    shapes = tensor_shapes(model_dir)
    if cfg.tie_word_embeddings or "lm_head.weight" not in shapes:
        if not cfg.tie_word_embeddings:
            raise CourseError(f"{model_dir}: untied embeddings but no lm_head.weight in the checkpoint")
        shapes.pop("lm_head.weight", None)  # tied: the embedding is used, whatever the file holds
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise CourseError(f"{model_dir}: checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
    for name, want in expected.items():
        got, path = shapes[name]
        if got != want:
            raise CourseError(f"{path}: {name} has shape {list(got)} but config.json implies {list(want)}")

"""One rank's part of Qwen3: the same modules as shared/model.py, narrower, with the split layers swapped in.

The rank's `config` describes its part (its heads, its MLP width), so L3's pool and kernels, built from
it, hold and read only this rank's KV heads without a line of change. `full_config` is the whole model.
"""
from __future__ import annotations

from pathlib import Path

import torch

from lessons.l10_tensor_parallel.group import TpGroup
from lessons.l10_tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                VocabParallelLMHead)
from lessons.l10_tensor_parallel.layout import TpLayout
from shared.checkpoint import load_state_dict
from shared.config import Qwen3Config
from shared.layers import RotaryEmbedding
from shared.model import Qwen3ForCausalLM, check_shapes


class TpQwen3ForCausalLM(Qwen3ForCausalLM):
    # Task L10.4: this rank's part of Qwen3: the split layers swapped in, only its slices loaded
    def __init__(self, cfg: Qwen3Config, layout: TpLayout, group: TpGroup):
        super().__init__(layout.local_config(cfg))
        self.full_config, self.layout, self.tp = cfg, layout, group
        e, d, local = cfg.hidden_size, cfg.head_dim, self.config
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj = ColumnParallelLinear(e, local.num_attention_heads * d)
            attn.k_proj = ColumnParallelLinear(e, local.num_key_value_heads * d)
            attn.v_proj = ColumnParallelLinear(e, local.num_key_value_heads * d)
            attn.o_proj = RowParallelLinear(local.num_attention_heads * d, e, group)  # all-reduce 1 of 2
            mlp.gate_proj = ColumnParallelLinear(e, local.intermediate_size)
            mlp.up_proj = ColumnParallelLinear(e, local.intermediate_size)
            mlp.down_proj = RowParallelLinear(local.intermediate_size, e, group)  # all-reduce 2 of 2
        self.model.embed_tokens = VocabParallelEmbedding(layout.vocab, e, group)
        self.lm_head = VocabParallelLMHead(e, layout.vocab, cfg.vocab_size, group)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, E] -> rank 0: fp32 logits [N, vocab], gathered from every rank; other ranks: None."""
        return self.lm_head(hidden)

    # Task L10.4: this rank's part of Qwen3: the split layers swapped in, only its slices loaded
    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, group: TpGroup) -> "TpQwen3ForCausalLM":
        """This rank's part, read from the same HF checkpoint as the whole model: only its slices are read."""
        cfg = Qwen3Config.from_dir(model_dir)
        layout = TpLayout.of(cfg, group.rank, group.size)  # a --tp this model cannot split fails here, on rank 0
        with group.lead("load", str(model_dir), str(dtype).removeprefix("torch.")):  # the followers load theirs
            with torch.device("meta"):
                model, whole = cls(cfg, layout, group), Qwen3ForCausalLM(cfg)
            check_shapes(whole, cfg, model_dir)  # the checkpoint against the whole model, from headers only
            state = load_state_dict(model_dir, dtype, group.device, layout.slice_of)
            if cfg.tie_word_embeddings or "lm_head.weight" not in state:
                state["lm_head.weight"] = state["model.embed_tokens.weight"]  # the same vocabulary rows
            model.load_state_dict({k: state[k] for k in model.state_dict()}, assign=True, strict=True)
            model.model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(group.device)
            return model.eval()

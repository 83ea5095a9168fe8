"""An early-exit draft model: the target's own first layers, then its final norm and LM head.

When no smaller model with the target's tokenizer exists (none ships for SmolLM2-135M), the target can
draft for itself by stopping early: run layers 0..L-1, normalise, project to the vocabulary. That is
self-speculation as in LayerSkip, without the training LayerSkip adds so that early layers predict well;
here the early layers were never asked to, so what they guess is measured, not assumed. Every weight is
the target's (nothing is copied); only the draft's KV pool is new, L/N of the target's in size.
DraftModelDrafter runs it like any other draft model.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from shared.errors import CourseError
from shared.model import Qwen3ForCausalLM


def early_exit(model: Qwen3ForCausalLM, layers: int) -> Qwen3ForCausalLM:
    """A model that shares `model`'s embedding, first `layers` decoder layers, final norm and LM head."""
    total = model.config.num_hidden_layers
    if not 1 <= layers < total:
        raise CourseError(f"--draft-layers must be 1 to {total - 1} (the target has {total} layers), got {layers}")
    with torch.device("meta"):  # a shell: every module is replaced by the target's own below
        shallow = Qwen3ForCausalLM(dataclasses.replace(model.config, num_hidden_layers=layers))
    body, target = shallow.model, model.model
    body.embed_tokens, body.norm, body.rotary = target.embed_tokens, target.norm, target.rotary
    body.layers = nn.ModuleList(target.layers[:layers])  # layer i keeps index i: its slot in the draft's pool
    shallow.lm_head = model.lm_head
    return shallow.eval()

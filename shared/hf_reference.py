"""The oracle: HuggingFace transformers' own greedy `generate`, run on the same files and token IDs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shared.generation import StopRule


@dataclass(frozen=True)
class HfOutput:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 logit at each generated position
    top_logits: list[float]  # the top-1 logit there: half-precision rounding scales with it


class HfReference:
    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        self.device = device

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], stop: StopRule) -> HfOutput:
        ids = torch.tensor([prompt_ids], device=self.device)
        eos = None if stop.ignore_eos or not stop.eos_token_ids else sorted(stop.eos_token_ids)
        out = self.model.generate(
            ids,
            # Explicit mask: without it generate guesses one from pad_token_id, and a prompt that
            # contains that id (token 0 is "!") gets positions masked out.
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=stop.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else 0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        top2 = [step[0].float().topk(2).values for step in out.logits[: len(tokens)]]
        return HfOutput(tokens, [float(t[0] - t[1]) for t in top2], [float(t[0]) for t in top2])

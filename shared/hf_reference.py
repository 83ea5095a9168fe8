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
    runner_ups: list[int]  # HF's second choice there: the only token a numerical tie can swap in


class HfReference:
    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        # generate() fills every option we leave unset from the checkpoint's generation_config.json, so a
        # checkpoint that ships repetition_penalty or top_k would change the oracle. Replace it with a
        # neutral one: plain greedy, no processors; EOS is passed explicitly per call.
        self.model.generation_config = GenerationConfig()
        self.model_dir, self.dtype, self.device = model_dir, dtype, device
        self._fp32 = None  # the arbiter's fp32 copy, loaded on the first divergence that needs it

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
        top2 = [step[0].float().topk(2) for step in out.logits[: len(tokens)]]
        # On an exact tie topk may list HF's pick second: the runner-up is whichever of the two HF did not emit.
        runner_ups = [int(t.indices[1] if int(t.indices[0]) == tok else t.indices[0]) for t, tok in zip(top2, tokens)]
        return HfOutput(
            tokens,
            margins=[float(t.values[0] - t.values[1]) for t in top2],
            top_logits=[float(t.values[0]) for t in top2],
            runner_ups=runner_ups,
        )

    @torch.inference_mode()
    def fp32_argmax(self, ids: list[int]) -> int:
        """HF's greedy choice after `ids`, computed in fp32 from the checkpoint: the arbiter of half-precision ties.

        Loaded from the files, not upcast from the half-precision model, so it sees the checkpoint's own
        weights rather than their rounded copies.
        """
        if self.dtype == torch.float32:
            model = self.model
        else:
            if self._fp32 is None:
                from transformers import AutoModelForCausalLM

                self._fp32 = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
                self._fp32 = self._fp32.to(self.device).eval()
            model = self._fp32
        x = torch.tensor([ids], device=self.device)
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), logits_to_keep=1).logits
        return int(logits[0, -1].argmax())

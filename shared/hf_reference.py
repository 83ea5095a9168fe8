"""The oracle: HuggingFace transformers' own greedy `generate`, run on the same files and token IDs, and
the same model scoring token lists it did not generate (ours, after a half-precision tie)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.generation import StopRule


NEAR = 8  # how many of HF's top logits each position keeps: a token outside them is not within rounding of the top


@dataclass(frozen=True)
class HfOutput:
    tokens: list[int]  # HF's pick at each position: what generate emitted, or what `score` says it would have
    margins: list[float]  # top-1 minus top-2 logit at each generated position
    top_logits: list[float]  # the top-1 logit there: half-precision rounding scales with it
    runner_ups: list[int]  # HF's second choice there
    # HF's logit for each of its NEAR best tokens at each position: how far below the top any candidate sits
    near: list[dict[int, float]] = field(default_factory=list)


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
    def generate(self, prompt_ids: list[int], stop: StopRule, logits_processor: list | None = None) -> HfOutput:
        """HF's greedy tokens; `logits_processor` (L13: a grammar's mask) runs on every step's scores, and the
        picks, margins and near tokens are read from what it returns (the raw logits' top may be forbidden)."""
        from transformers import LogitsProcessorList

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
            output_scores=bool(logits_processor),
            return_dict_in_generate=True,
            logits_processor=LogitsProcessorList(logits_processor or []),
        )
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        rows = out.scores if logits_processor else out.logits
        return _picks(torch.stack([step[0] for step in rows[: len(tokens)]]), tokens)

    @torch.inference_mode()
    def score(self, ids: list[int], start: int, fp32: bool = False, logits_processor=None) -> HfOutput:
        """HF's choice after ids[:k] for each k from `start` to len(ids), from one teacher-forced forward.

        How HF judges tokens it did not generate: after a half-precision tie our continuation is no longer
        HF's, so HF reads ours (prompt + our tokens) and says what it would have picked at each position.
        Entry j is about position start + j; the last one is HF's choice after all of `ids`. `fp32`: the
        arbiter's model, loaded from the checkpoint, instead of the run's dtype. `logits_processor` (a fresh one,
        L13's grammar) sees each row as generate would have shown it: after ids[:start + j].
        """
        model = self._fp32_model() if fp32 else self.model
        x = torch.tensor([ids], device=self.device)
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), logits_to_keep=len(ids) - start + 1).logits[0]
        if logits_processor is not None:
            logits = torch.cat([logits_processor(x[:, :start + j], logits[j:j + 1]) for j in range(len(logits))])
        return _picks(logits, logits.argmax(-1).tolist())  # argmax: generate's greedy pick (the first on an exact tie)

    def fp32_argmax(self, ids: list[int]) -> int:
        """HF's greedy choice after `ids`, computed in fp32 from the checkpoint: the arbiter of half-precision ties.

        Loaded from the files, not upcast from the half-precision model, so it sees the checkpoint's own
        weights rather than their rounded copies.
        """
        return self.score(ids, len(ids), fp32=True).tokens[0]

    def _fp32_model(self):
        if self.dtype == torch.float32:
            return self.model
        if self._fp32 is None:
            from transformers import AutoModelForCausalLM

            self._fp32 = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
            self._fp32 = self._fp32.to(self.device).eval()
        return self._fp32


def _picks(logits: torch.Tensor, tokens: list[int]) -> HfOutput:
    """One row of logits per position and the token picked there: margins, top logits, runner-ups, near tokens."""
    values, indices = logits.float().topk(NEAR, dim=-1)
    # On an exact tie topk may list the pick second: the runner-up is whichever of the two was not picked.
    runner_ups = [i[1] if i[0] == tok else i[0] for i, tok in zip(indices.tolist(), tokens)]
    return HfOutput(tokens, margins=(values[:, 0] - values[:, 1]).tolist(), top_logits=values[:, 0].tolist(),
                    runner_ups=runner_ups,
                    near=[dict(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())])

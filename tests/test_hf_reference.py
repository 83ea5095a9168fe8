"""The oracle itself: plain greedy whatever the checkpoint's generation_config.json asks for."""
import json
import shutil

import torch

from conftest import CPU
from lessons.l1_contiguous import L1Engine
from shared.generation import StopRule
from shared.hf_reference import HfReference
from shared.model import Qwen3ForCausalLM

# Options a published checkpoint may ship; each one alone changes greedy output.
NOT_NEUTRAL = {"repetition_penalty": 1.8, "no_repeat_ngram_size": 2, "suppress_tokens": [0, 11], "do_sample": True,
               "top_k": 5, "temperature": 0.7}


def test_checkpoint_generation_config_does_not_leak_into_the_reference(tiny_dir, tmp_path, prompt_ids):
    ckpt = tmp_path / "opinionated"
    shutil.copytree(tiny_dir, ckpt)
    gen = json.loads((ckpt / "generation_config.json").read_text()) | NOT_NEUTRAL
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    ids, stop = prompt_ids[0] + prompt_ids[0], StopRule(24, ignore_eos=True)  # a repeated phrase: penalties bite

    ref = HfReference(ckpt, torch.float32, CPU)
    ours = L1Engine(Qwen3ForCausalLM.from_dir(ckpt, torch.float32, CPU)).generate(ids, stop)
    assert ref.generate(ids, stop).tokens == ours

    # The test can see the leak: HF left to its own defaults follows the file and disagrees with greedy.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    torch.manual_seed(0)
    leaky = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, pad_token_id=0)[0, len(ids):].tolist()
    assert leaky != ours


def test_the_fp32_arbiter_is_hf_in_fp32_from_the_checkpoint(tiny_dir, prompt_ids, hf):
    """A bf16 reference arbitrates with the checkpoint's fp32 weights: it agrees with the fp32 reference's
    greedy tokens at every position, not with its own bf16 run."""
    stop = StopRule(12, ignore_eos=True)
    bf16 = HfReference(tiny_dir, torch.bfloat16, CPU)
    for ids in prompt_ids[:2]:
        fp32_tokens = hf.generate(ids, stop).tokens
        picks = [bf16.fp32_argmax(ids + fp32_tokens[:i]) for i in range(len(fp32_tokens))]
        assert picks == fp32_tokens
    assert bf16._fp32 is not None and next(bf16._fp32.parameters()).dtype == torch.float32
    assert next(bf16.model.parameters()).dtype == torch.bfloat16  # the reference itself stays in bf16

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


def test_the_scorer_is_hf_it_reproduces_generate_on_hfs_own_tokens(prompt_ids, hf):
    """After a tie, HF judges our tokens by one teacher-forced forward (`score`). Fed HF's own greedy tokens
    in fp32 it must say what `generate` said at every position: the same picks, the same logits up to the
    summation order of a full forward against an incremental one, and the same runner-ups."""
    stop = StopRule(20, ignore_eos=True)
    for ids in prompt_ids:
        gen = hf.generate(ids, stop)
        scored = hf.ref.score(ids + gen.tokens, len(ids))
        assert len(scored.tokens) == len(gen.tokens) + 1  # and one more: HF's choice after the last token
        assert scored.tokens[:-1] == gen.tokens
        assert scored.runner_ups[:-1] == gen.runner_ups
        # fp32 sums in another order (a T-row forward, not T one-row steps; and the thread count changes blocking):
        # measured 6.9e-5 (Intel Xeon AMX), 5.3e-5 (torch capped to AVX2) at logits up to 59: 9x margin
        torch.testing.assert_close(scored.top_logits[:-1], gen.top_logits, rtol=1e-5, atol=1e-4)
        # a margin is a difference of two such logits: its error is theirs, absolute, not relative to it; measured
        # 9.9e-5 (Intel Xeon AMX), 1.0e-4 (torch capped to AVX2): 10x margin
        torch.testing.assert_close(scored.margins[:-1], gen.margins, rtol=0, atol=1e-3)
        assert hf.ref.fp32_argmax(ids + gen.tokens) == scored.tokens[-1]  # the arbiter is that forward's last row

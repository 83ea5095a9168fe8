"""The grammar on HF's side: a transformers LogitsProcessor that masks `generate`'s scores with a matcher.

The parity rule's reference for L13: HF `generate`, greedy, with this processor, must give the engine's
tokens. It runs a fresh matcher of the same compiled grammar through the tokens HF generates, one step at a
time, and sets every forbidden score to -inf, as the engine does to its logits. (The mask itself is checked
against a brute-force reference in the tests, so agreeing with this processor is not agreeing with itself.)
`GrammarOracle` is HF with the grammar for shared/parity.py: generate, and score our tokens after a
half-precision tie, both under the mask (unmasked, HF's choice could be a token the grammar forbids).
"""
from __future__ import annotations

import torch
from transformers import LogitsProcessor

from lessons.l13_structured import mask
from lessons.l13_structured.grammar import Grammar
from shared.generation import StopRule
from shared.hf_reference import HfOutput, HfReference


class GrammarLogitsProcessor(LogitsProcessor):
    def __init__(self, grammar: Grammar, prompt_len: int):
        self.matcher = grammar.matcher()
        self.prompt_len = prompt_len
        self.consumed = 0  # generated tokens the matcher has taken in
        self.bitmask = mask.allocate(1, grammar.vocab_size)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[0, self.prompt_len:].tolist()  # one sequence: generate's greedy batch of one
        self.matcher.consume_tokens(generated[self.consumed:])
        self.consumed = len(generated)
        mask.fill(self.matcher, self.bitmask, 0)
        scores = scores.clone()  # generate may keep the raw scores (output_logits)
        mask.apply(scores, self.bitmask)
        return scores


class GrammarOracle:
    """HfReference with one request's grammar on every step: what shared.parity.compare asks as its oracle."""

    def __init__(self, hf: HfReference, grammar: Grammar, prompt_len: int):
        self.hf, self.grammar, self.prompt_len = hf, grammar, prompt_len

    def processor(self) -> GrammarLogitsProcessor:
        return GrammarLogitsProcessor(self.grammar, self.prompt_len)

    def generate(self, prompt_ids: list[int], stop: StopRule) -> HfOutput:
        return self.hf.generate(prompt_ids, stop, [self.processor()])

    def score(self, ids: list[int], start: int, fp32: bool = False) -> HfOutput:
        return self.hf.score(ids, start, fp32, self.processor())

    def fp32_argmax(self, ids: list[int]) -> int:
        return self.score(ids, len(ids), fp32=True).tokens[0]

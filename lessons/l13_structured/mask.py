"""The token mask: one bit per vocabulary token, set when appending that token keeps the output a valid prefix.

llguidance writes the mask as 32-bit words (token t is bit t % 32 of word t // 32, lowest bit first), the
layout vLLM and SGLang pass around too: 151,936 tokens fit in 19 KB. The engine turns a row of it into a
boolean row and sets every disallowed logit to -inf *before* L4's sampler sees the row, so temperature,
top-k and top-p act on the allowed tokens only (after them, top-k could keep k tokens that are all banned).
"""
from __future__ import annotations

import math

import llguidance
import torch

WORD_BITS = 32
# byte value -> its 8 bits, lowest first: a byte-wise lookup unpacks a 19 KB mask in one gather
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask [rows, ceil(vocab / 32)] on the CPU (where llguidance writes)."""
    return torch.zeros(rows, (vocab_size + WORD_BITS - 1) // WORD_BITS, dtype=torch.int32)


def fill(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """The matcher's mask for its current state into row `row` (llguidance lets go of the GIL meanwhile)."""
    words = bitmask[row]
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


def allowed_rows(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask rows [R, W] int32 -> bool [R, vocab_size]. Little-endian bytes: byte b of word w holds tokens
    32w + 8b .. 32w + 8b + 7."""
    rows = bitmask.shape[0]
    return _BYTE_BITS[bitmask.contiguous().view(torch.uint8).long()].view(rows, -1)[:, :vocab_size]


def is_allowed(words: torch.Tensor, token: int) -> bool:
    """One bit of one bitmask row: is `token` allowed?"""
    return bool((int(words[token // WORD_BITS]) >> (token % WORD_BITS)) & 1)


def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Every disallowed token's logit -> -inf, in place: logits [R, V] (any device), bitmask [R, W]."""
    keep = allowed_rows(bitmask, logits.shape[-1]).to(logits.device)
    logits.masked_fill_(~keep, -math.inf)

"""The token mask: one bit per vocabulary token, set when appending that token keeps the output a valid prefix.

llguidance writes the mask as 32-bit words (token t is bit t % 32 of word t // 32, lowest bit first), the
layout vLLM and SGLang pass around too: 151,936 tokens fit in 19 KB. The engine adds -inf to every
disallowed logit *before* L4's sampler sees the row, so temperature, top-k and top-p act on the allowed
tokens only (after them, top-k could keep k tokens that are all banned).
"""
from __future__ import annotations

import math
import threading

import llguidance
import torch

WORD_BITS = 32
# byte value -> its 8 bits, lowest first: a byte-wise lookup unpacks a 19 KB mask in one gather
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
# the same 8 bools read as one int64 per byte value: a 1-D gather of int64s by an int32 index is ~15x faster
# on a CPU than gathering [256, 8] rows by an int64 index (the layout in memory is the same bytes)
_BYTE_WORDS = _BYTE_BITS.contiguous().view(torch.int64).view(256)
# byte value -> 8 additive logit biases (0 allowed, -inf not), per (device, dtype), made on first use
_BYTE_BIAS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
# per thread, per (device, dtype), on a CPU: the bias rows' buffer, kept between steps (R x V x 4 bytes: 9.7 MB at
# 16 rows of fp32). A fresh [R, V] float tensor each step is a fresh mapping of megabytes whose page faults cost
# more than filling it (in the engine at 16 rows apply took about half the time with the buffer kept); per
# thread, as two engines may mask at once.
_SCRATCH = threading.local()


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask [rows, ceil(vocab / 32)] on the CPU (where llguidance writes)."""
    return torch.zeros(rows, (vocab_size + WORD_BITS - 1) // WORD_BITS, dtype=torch.int32)


def fill(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """The matcher's mask for its current state into row `row` (llguidance lets go of the GIL meanwhile)."""
    words = bitmask[row]
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


# Task L13.1: the mask layout: token t is bit t % 32 of int32 word t // 32; bitmask [R, W] -> allowed bool [R, V]
def allowed_rows(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask rows [R, W] int32 -> bool [R, vocab_size]. Little-endian bytes: byte b of word w holds tokens
    32w + 8b .. 32w + 8b + 7."""
    rows, words = bitmask.shape
    index = bitmask.contiguous().view(torch.uint8).reshape(-1).int()
    return _BYTE_WORDS.index_select(0, index).view(torch.bool).view(rows, words * WORD_BITS)[:, :vocab_size]


# Task L13.1: the mask layout: token t is bit t % 32 of int32 word t // 32; bitmask [R, W] -> allowed bool [R, V]
def is_allowed(words: torch.Tensor, token: int) -> bool:
    """One bit of one bitmask row: is `token` allowed?"""
    return bool((int(words[token // WORD_BITS]) >> (token % WORD_BITS)) & 1)


# Task L13.2: apply a mask before sampling: every disallowed logit of [R, V] to -inf, in place, the rest untouched
def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Every disallowed token's logit -> -inf, in place: logits [R, V] (any device), bitmask [R, W].

    Done as one add of a 0 / -inf bias gathered per mask byte on the logits' device: x + 0 is x and x + -inf is
    -inf for every finite logit (a model's are). On a CPU one gather plus one add over [R, V] costs about a
    tenth of unpacking to booleans, negating them and masked_fill (16 rows of 151,936 on one thread: ~2 ms
    against ~23 ms), and that was most of a constrained decode step's extra time at batch 16."""
    rows, vocab = logits.shape
    key = (logits.device, logits.dtype)
    if key not in _BYTE_BIAS:
        _BYTE_BIAS[key] = torch.zeros((), dtype=logits.dtype).masked_fill(~_BYTE_BITS, -math.inf).to(logits.device)
    index = bitmask.to(logits.device).contiguous().view(torch.uint8).reshape(-1).int()
    if bitmask.shape[0] != rows or bitmask.shape[1] * WORD_BITS < vocab:
        raise ValueError(f"a bitmask {list(bitmask.shape)} does not cover logits {list(logits.shape)}")
    if logits.device.type == "cpu":
        buffers = _SCRATCH.__dict__.setdefault("bias", {})
        mode = (*key, torch.is_inference_mode_enabled())  # an inference tensor cannot be written outside the mode
        if mode not in buffers or buffers[mode].shape[0] < index.numel():
            buffers[mode] = torch.empty(index.numel(), 8, dtype=logits.dtype, device=logits.device)
        bias = buffers[mode][:index.numel()]
    else:  # a GPU's caching allocator already reuses the block
        bias = torch.empty(index.numel(), 8, dtype=logits.dtype, device=logits.device)
    torch.index_select(_BYTE_BIAS[key], 0, index, out=bias)
    logits.add_(bias.view(rows, bitmask.shape[1] * WORD_BITS)[:, :vocab])

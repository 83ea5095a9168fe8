"""Reference attention for one request over its gathered history; every lesson's CPU path ends here."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Tq, Hq, D] are the last Tq tokens of a history k, v [Tk, Hkv, D]; returns [Tq, Hq, D].

    The causal mask is bottom-right aligned: query row i sits at position Tk - Tq + i and sees keys
    0 .. Tk - Tq + i. A decode step (Tq = 1) sees everything. GQA: each group of Hq / Hkv query heads
    shares one key/value head.
    """
    tq, tk = q.shape[0], k.shape[0]
    mask = None
    if tq > 1:
        q_pos = torch.arange(tk - tq, tk, device=q.device)[:, None]
        mask = torch.arange(tk, device=q.device)[None, :] <= q_pos  # [Tq, Tk], True = may attend
    # enable_gqa: SDPA broadcasts each KV head over its query group itself, without copying K/V per head.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(0, 1)

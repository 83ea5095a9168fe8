"""The torch backend (the CPU path and the oracle) against dense causal attention on random ragged batches."""
from __future__ import annotations

import math

import pytest
import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.backends.torch_backend import TorchBackend
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l3_block_tensor.kv_pool import BlockKvPool
from shared.config import Qwen3Config

CPU = torch.device("cpu")


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Written out by hand, independent of shared.attention: q [Tq, Hq, D] are the last Tq of Tk keys."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    out = torch.empty_like(q)
    for h in range(hq):
        scores = q[:, h] @ k[:, h // group].T / math.sqrt(d)  # [Tq, Tk]
        q_pos = torch.arange(tk - tq, tk)[:, None]
        scores = scores.masked_fill(torch.arange(tk)[None, :] > q_pos, float("-inf"))
        out[:, h] = scores.softmax(dim=-1) @ v[:, h // group]
    return out


def random_batch(seed: int, s: int, hq: int, hkv: int, d: int = 16, num_blocks: int = 96):
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered pages, never in order
    k_pages = torch.randn(num_blocks, s, hkv, d, generator=g)  # garbage everywhere: a wrong page shows
    v_pages = torch.randn(num_blocks, s, hkv, d, generator=g)
    reqs, dense, qs = [], [], []
    kv_lens = [1, 2 * s + 1, s, 3 * s + 2, 5]
    for i, kv_len in enumerate(kv_lens):
        q_len = [1, kv_len, 1, max(1, kv_len - s), min(3, kv_len)][i]  # decodes, full prefills, partial
        n_pages = -(-kv_len // s)
        blocks = [free.pop() for _ in range(n_pages)]
        r = Request(list(range(kv_len)), s, blocks=blocks, num_cached=kv_len - q_len)
        slots = torch.tensor(r.slots(0, kv_len))
        dense.append((k_pages.flatten(0, 1)[slots], v_pages.flatten(0, 1)[slots]))
        qs.append(torch.randn(q_len, hq, d, generator=g))
        reqs.append(r)
    return reqs, k_pages, v_pages, qs, dense


@pytest.mark.task("L3.3")
@pytest.mark.parametrize("s", [1, 7, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 8), (6, 2), (8, 1)])
def test_matches_dense_causal_attention(s: int, hq: int, hkv: int):
    reqs, k_pages, v_pages, qs, dense = random_batch(seed=s * 100 + hq * 10 + hkv, s=s, hq=hq, hkv=hkv)
    meta = BatchMeta.build(reqs, s, CPU)
    backend = TorchBackend()
    backend.plan(meta)
    out = backend.run(torch.cat(qs), k_pages, v_pages, meta)
    want = torch.cat([dense_reference(q, k, v) for q, (k, v) in zip(qs, dense)])
    assert out.shape == want.shape
    # measured 4.8e-7 (Intel Xeon AMX), 7.2e-7 (torch capped to AVX2): 36x margin
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.task("L3.3")
def test_run_without_plan_is_refused():
    reqs, k_pages, v_pages, qs, _ = random_batch(seed=0, s=4, hq=4, hkv=2)
    backend = TorchBackend()
    backend.plan(BatchMeta.build(reqs[:1], 4, CPU))
    with pytest.raises(RuntimeError, match="plan"):
        backend.run(torch.cat(qs), k_pages, v_pages, BatchMeta.build(reqs, 4, CPU))


@pytest.mark.task("L3.1")
def test_pool_flat_view_is_l2_slot_convention():
    cfg = Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=64, tie_word_embeddings=True, eos_token_ids=())
    pool = BlockKvPool(cfg, num_blocks=5, block_size=3, dtype=torch.float32, device=CPU)
    assert pool.k[1].shape == (5, 3, 2, 4)
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    pool.write(1, k, v, torch.tensor([3 * 3 + 2, 0]))  # slot 11 = block 3, offset 2
    torch.testing.assert_close(pool.k[1][3, 2], k[0])
    torch.testing.assert_close(pool.v[1][0, 0], v[1])
    assert pool.k[0].abs().sum() == 0  # other layers untouched

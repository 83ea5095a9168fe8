"""shared/layers.py's RoPE: a step's cos and sin are built once for every layer, and rotating with them gives
HF Qwen3's q and k to the bit, in fp32 and bf16 (the tables store sin's first half negated)."""
import pytest
import torch
from transformers import Qwen3Config as HfQwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from shared.attention import causal_attention
from shared.layers import RotaryEmbedding

HQ, HKV, D, THETA = 4, 2, 64, 1_000_000.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_hfs_to_the_bit(dtype):
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 2, 3, 511, 512, 4095, 40959])  # far positions: large angles, sin and cos < 0
    q, k = torch.randn(len(positions), HQ, D).to(dtype), torch.randn(len(positions), HKV, D).to(dtype)
    hf_cfg = HfQwen3Config(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D,
                           rope_parameters={"rope_type": "default", "rope_theta": THETA})
    cos, sin = Qwen3RotaryEmbedding(hf_cfg)(q, positions[None])  # [1, T, D]; HF's q, k are [B, H, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    rope = RotaryEmbedding(D, THETA)
    ours_q, ours_k = rope(q, k, rope.tables(positions, dtype))
    assert ours_q.dtype == dtype and torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ours_k, hf_k[0].transpose(0, 1))
    assert not torch.equal(ours_q, q)  # the rotation did something


class OneShotAttention:
    """The KV seam for one whole prompt with no cache: attend over this step's own keys."""

    def attend(self, layer, q, k, v, meta):
        return causal_attention(q, k, v)


def test_a_forward_builds_the_rope_tables_once_for_all_layers(tiny_model, monkeypatch):
    rope, built = tiny_model.model.rotary, []
    tables = rope.tables
    monkeypatch.setattr(rope, "tables", lambda positions, dtype: built.append(len(positions)) or tables(positions, dtype))
    tiny_model(torch.tensor([5, 6, 7]), torch.arange(3), OneShotAttention(), None)
    assert len(tiny_model.model.layers) > 1 and built == [3]

"""L1's build-track tests (scripts/course.py check L1): one task at a time, failing in a learner's terms."""
import pytest
import torch

from conftest import assert_same_tokens
from lessons.l1_contiguous import L1Engine
from lessons.l1_contiguous.kv_cache import ContiguousKvCache, ContiguousMeta
from shared.attention import causal_attention
from shared.generation import StopRule


@pytest.mark.task("L1.1")
def test_the_cache_holds_zeroed_k_and_v_per_layer(tiny_model):
    cfg = tiny_model.config
    cache = ContiguousKvCache(cfg, 37, torch.bfloat16, torch.device("cpu"))
    want = (37, cfg.num_key_value_heads, cfg.head_dim)
    for name in ("k", "v"):
        layers = getattr(cache, name)
        assert len(layers) == cfg.num_hidden_layers, f"cache.{name} has {len(layers)} layers, the model {cfg.num_hidden_layers}"
        for i, t in enumerate(layers):
            assert tuple(t.shape) == want, f"cache.{name}[{i}] is {tuple(t.shape)}, want [max_seq_len, Hkv, D] = {want}"
            assert t.dtype == torch.bfloat16, f"cache.{name}[{i}] is {t.dtype}, want the dtype asked for"
            assert not t.any(), f"cache.{name}[{i}] is not zero-filled"
    assert cache.k[0].data_ptr() != cache.v[0].data_ptr() and cache.k[0].data_ptr() != cache.k[1].data_ptr(), \
        "K and V, and each layer, need tensors of their own"


@pytest.mark.task("L1.2")
def test_attend_writes_rows_at_start_and_reads_the_whole_history(tiny_model):
    cfg = tiny_model.config
    cache = ContiguousKvCache(cfg, 8, torch.float32, torch.device("cpu"))
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, d, generator=g) for h in (hq, hkv, hkv))
    out = cache.attend(1, q[:4], k[:4], v[:4], ContiguousMeta(0))  # the prefill: rows 0..3
    assert torch.equal(cache.k[1][:4], k[:4]), "after a 4-token prefill, layer 1's K rows 0..3 should hold its keys"
    assert not cache.k[0].any(), "attend(layer=1, ...) wrote into layer 0"
    assert torch.allclose(out, causal_attention(q[:4], k[:4], v[:4])), "the prefill's output is not causal attention over rows 0..3"
    out = cache.attend(1, q[4:], k[4:], v[4:], ContiguousMeta(4))  # a decode at position 4
    assert torch.equal(cache.v[1][4], v[4]), "a decode at start=4 should write V row 4"
    assert torch.equal(cache.k[1][:4], k[:4]), "the decode overwrote the prompt's K rows"
    want = causal_attention(q[4:], k, v)
    # the reference lesson's output is bit-equal to causal_attention here (Intel Xeon AMX; torch capped to AVX2)
    assert torch.allclose(out, want, atol=1e-6), "the decode's output is not attention over all 5 rows (history + itself)"


@pytest.mark.task("L1.3")
def test_generate_matches_hf_token_for_token(tiny_model, hf, prompt_ids):
    stop = StopRule(12, ignore_eos=True)
    engine = L1Engine(tiny_model)
    for i, ids in enumerate(prompt_ids):
        assert_same_tokens(engine.generate(ids, stop), hf.generate(ids, stop).tokens, f"prompt {i}")


@pytest.mark.task("L1.3")
def test_generate_prefills_once_then_feeds_one_token_a_step(tiny_model, fed_tokens):
    L1Engine(tiny_model).generate(list(range(100, 109)), StopRule(4, ignore_eos=True))
    assert fed_tokens == [9, 1, 1, 1], (f"tokens fed per forward: {fed_tokens}; want the 9-token prompt once, then "
                                        "one token a step")

"""L2's build-track tests for the pool's attention and the engine (scripts/course.py check L2); the allocator's, the
block table's and the step metadata's are in test_l2_allocator.py and test_l2_reserve.py."""
import pytest
import torch

from conftest import assert_same_tokens
from lessons.l2_token_flat import L2Engine
from lessons.l2_token_flat.forward_meta import ForwardMeta
from lessons.l2_token_flat.kv_pool import KvPool
from shared.attention import causal_attention
from shared.errors import CourseError, PoolExhausted
from shared.generation import StopRule


@pytest.mark.task("L2.5")
def test_attend_scatters_by_slot_and_gathers_the_history_in_position_order(tiny_model):
    cfg = tiny_model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pool = KvPool(cfg, 12, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, d, generator=g) for h in (hq, hkv, hkv))
    slots = [9, 10, 11, 4, 5]  # block table [3, 1] with S = 3: positions 0..4
    meta = ForwardMeta(torch.arange(4), torch.tensor(slots[:4]), torch.tensor(slots[:4]), True)
    out = pool.attend(2, q[:4], k[:4], v[:4], meta)
    for pos, slot in enumerate(slots[:4]):
        assert torch.equal(pool.k[2][slot], k[pos]), f"position {pos}'s key belongs in slot {slot} (slot_mapping)"
    assert not pool.k[0].any(), "attend(layer=2, ...) wrote into layer 0"
    assert torch.allclose(out, causal_attention(q[:4], k[:4], v[:4])), "the prefill's output is not attention over its rows"
    meta = ForwardMeta(torch.tensor([4]), torch.tensor([5]), torch.tensor(slots), False)
    out = pool.attend(2, q[4:], k[4:], v[4:], meta)
    assert torch.equal(pool.v[2][5], v[4]), "the decode's value belongs in slot 5"
    # the reference lesson's output is bit-equal to causal_attention here (Intel Xeon AMX; torch capped to AVX2)
    assert torch.allclose(out, causal_attention(q[4:], k, v), atol=1e-6), (
        "the decode's output is not attention over slots [9, 10, 11, 4, 5] in that (position) order")


@pytest.mark.task("L2.6")
@pytest.mark.parametrize("block_size", [1, 7])
def test_generate_matches_hf_and_frees_every_block(tiny_model, hf, prompt_ids, block_size):
    stop = StopRule(12, ignore_eos=True)
    engine = L2Engine(tiny_model, block_size=block_size)
    for i, ids in enumerate(prompt_ids):
        assert_same_tokens(engine.generate(ids, stop), hf.generate(ids, stop).tokens, f"block size {block_size}, prompt {i}")
        assert engine.allocator.num_free == engine.allocator.num_blocks, (
            f"after prompt {i}, {engine.allocator.num_blocks - engine.allocator.num_free} blocks were never freed")


@pytest.mark.task("L2.6")
def test_generate_prefills_once_then_feeds_one_token_a_step(tiny_model, fed_tokens):
    """Parity cannot see an engine that recomputes the whole history every step (it rewrites the same K/V into the
    same slots); the tokens each forward is fed can."""
    L2Engine(tiny_model, block_size=4).generate(list(range(100, 109)), StopRule(6, ignore_eos=True))
    assert fed_tokens[:1] == [9], f"the first step fed {fed_tokens[:1]} tokens; want the 9-token prompt (all fed: {fed_tokens})"
    for step, n in enumerate(fed_tokens[1:], start=2):
        assert n == 1, (f"step {step} fed {n} tokens: the cache is not reused (num_cached never advanced); after the "
                        f"prefill each step feeds 1 (all fed: {fed_tokens})")
    assert len(fed_tokens) == 6, f"{len(fed_tokens)} forwards for 6 new tokens; want 6 (all fed: {fed_tokens})"


@pytest.mark.task("L2.6")
def test_a_request_the_pool_can_never_hold_is_refused_before_the_first_step(tiny_model, fed_tokens):
    engine = L2Engine(tiny_model, block_size=4, num_blocks=3)  # 10 + 10 - 1 tokens need 5 blocks of 4
    try:
        engine.generate(list(range(10, 20)), StopRule(10))
    except PoolExhausted:
        pytest.fail(f"a request needing 5 blocks of a 3-block pool failed halfway, with PoolExhausted after "
                    f"{len(fed_tokens)} forwards: refuse it up front (check_fits) before the first step")
    except CourseError:
        pass
    else:
        pytest.fail("a request needing 5 blocks of a 3-block pool ran: refuse it up front (check_fits, CourseError)")
    assert fed_tokens == [], f"refused only after {len(fed_tokens)} forwards: call check_fits before the first step"
    assert engine.allocator.num_free == 3, f"the refused request left {3 - engine.allocator.num_free} blocks held"

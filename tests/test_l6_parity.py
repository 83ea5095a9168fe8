"""L6 on the real (tiny) model: regressions for bugs users of other small engines hit with prefix caching,
each with greedy parity against HF for every prompt alone."""
import pytest

from lessons.l4_continuous.engine import Arrival
from lessons.l6_prefix_sharing import L6Engine
from shared.generation import StopRule

NEW = 6


def stop_for(model, new: int = NEW) -> StopRule:
    return StopRule(new, frozenset(model.config.eos_token_ids), ignore_eos=True)


@pytest.fixture(scope="module")
def shared(prompt_ids) -> list[list[int]]:
    """A 16-token common prefix (4 blocks of 4), then each conftest prompt's own tokens."""
    head = prompt_ids[3][:16]
    return [head + p[:6] for p in prompt_ids[:3]]


@pytest.mark.parametrize("cut", [16, 15, 13])
def test_a_fully_cached_prompt_still_feeds_a_token(tiny_model, hf, prompt_ids, cut):
    """The second prompt is entirely cached (cut 16: block-aligned). Matching all 4 blocks would leave an
    empty query (no logits) or rewrite position 15 into a shared full block; the match stops at 3."""
    stop = stop_for(tiny_model)
    first, second = prompt_ids[3][:20], prompt_ids[3][:cut]
    engine = L6Engine(tiny_model, 4, 64, backend="torch")
    got = engine.run([Arrival(first, stop, step=0), Arrival(second, stop, step=2)])
    assert got == [hf.generate(first, stop).tokens, hf.generate(second, stop).tokens]
    assert engine.stats.cached_tokens == 4 * ((cut - 1) // 4)
    assert engine.allocator.num_free == 64


@pytest.mark.task("L6.7")
@pytest.mark.parametrize("wait", [False, True])
def test_two_requests_with_one_prefix_in_one_step(tiny_model, hf, shared, wait):
    """Without waiting, both are admitted in one step: neither may hit the other's blocks (not written
    yet), and the prefix is registered once (the second table keeps its own private copy); a later
    request hits. With wait_for_inflight (the default) the second waits one step and hits too."""
    stop = stop_for(tiny_model)
    engine = L6Engine(tiny_model, 4, 64, backend="torch", wait_for_inflight=wait)
    got = engine.run([Arrival(shared[0], stop, step=0), Arrival(shared[1], stop, step=0),
                      Arrival(shared[2], stop, step=3)])
    assert got == [hf.generate(p, stop).tokens for p in shared]
    assert engine.stats.cached_tokens == (32 if wait else 16)
    prefixes = [engine.cache.prefix(b) for b in engine.cache.entry]
    assert len(prefixes) == len(set(prefixes)), "a prefix registered twice"
    assert all(r == 0 for r in engine.allocator.ref)


def test_a_preempted_request_re_prefills_from_the_cache(tiny_model, hf, shared):
    """Recompute after preemption hits the victim's own cached blocks, generated tokens included; its
    token count (prompt + generated, the last one never fed) must come out right."""
    stop = stop_for(tiny_model, 12)
    prompts = [shared[0], shared[1][16:]]  # 22 + 12 - 1 = 33 tokens: 9 blocks; the short one 6 + 11: 5
    engine = L6Engine(tiny_model, 4, 11, backend="torch")
    got = engine.run([Arrival(p, stop, step=i) for i, p in enumerate(prompts)])
    assert got == [hf.generate(p, stop).tokens for p in prompts]
    s = engine.stats
    assert s.preemptions > 0 and s.cached_tokens > 0
    assert s.prompt_tokens > sum(len(p) for p in prompts)  # a re-admission counted its generated tokens
    assert engine.allocator.num_free == 11


def test_many_requests_with_preemption_and_hits_at_once(tiny_model, hf, shared, prompt_ids):
    stop = stop_for(tiny_model, 8)
    prompts = shared + [prompt_ids[3][:18], prompt_ids[3][:24], shared[0][:17]]
    engine = L6Engine(tiny_model, 4, 12, backend="torch", max_running=4)
    got = engine.run([Arrival(p, stop, step=i // 2) for i, p in enumerate(prompts)])
    assert got == [hf.generate(p, stop).tokens for p in prompts]
    s = engine.stats
    assert s.preemptions > 0 and s.cached_tokens > 0
    assert all(r == 0 for r in engine.allocator.ref) and engine.allocator.num_free == 12

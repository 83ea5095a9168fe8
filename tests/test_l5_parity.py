"""L5 on the real (tiny) model: forced preemption under both policies keeps greedy parity with HF."""
import pytest

from lessons.l2_token_flat.engine import blocks_for
from lessons.l4_continuous import L4Engine
from lessons.l5_preemption import L5Engine
from shared.generation import StopRule

NEW = 12


@pytest.mark.parametrize("policy,host_blocks", [("recompute", None), ("swap", None), ("swap", 4)])
@pytest.mark.parametrize("block_size", [2, 4])
def test_forced_preemption_keeps_parity(tiny_model, hf, prompt_ids, policy, host_blocks, block_size):
    prompt_ids = prompt_ids[:3]  # short prompts that grow past several block boundaries while decoding
    stop = StopRule(NEW, frozenset(tiny_model.config.eos_token_ids), ignore_eos=True)
    # The biggest request alone fits with one block to spare; all of them together cannot.
    n = 1 + max(blocks_for(len(p) + NEW - 1, block_size) for p in prompt_ids)
    engine = L5Engine(tiny_model, block_size, n, backend="torch", policy=policy, host_blocks=host_blocks)
    got = engine.generate_batch(prompt_ids, stop, stagger=1)
    assert got == [hf.generate(p, stop).tokens for p in prompt_ids]
    s = engine.stats
    assert s.preemptions > 0, f"the pool of {n} blocks never ran dry: this test would prove nothing about L5"
    if policy == "swap" and host_blocks is None:
        assert s.swaps_out == s.swaps_in == s.preemptions  # the host pool always had room
    if policy == "recompute":
        assert s.swaps_out == 0
    assert engine.allocator.num_free == n
    # Optimistic admission runs more requests together than L4's promise-based admission.
    l4 = L4Engine(tiny_model, block_size, n, backend="torch")
    assert l4.generate_batch(prompt_ids, stop, stagger=1) == got
    assert s.peak_running >= l4.stats.peak_running

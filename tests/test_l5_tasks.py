"""L5's build-track tests (scripts/course.py check L5) where no existing test fits: the host pool's copies, and the
preempting scheduler's preempt and admit driven by hand, before its schedule exists. The schedule's tests are in
test_l5_scheduler.py (the engine on the fake runner)."""
import pytest
import torch

from lessons.l2_token_flat.block_allocator import BlockAllocator
from lessons.l3_block_tensor.kv_pool import BlockKvPool
from lessons.l4_continuous.sequence import Sequence, Status
from lessons.l4_continuous.stats import EngineStats
from lessons.l5_preemption.host_pool import HostKvPool
from lessons.l5_preemption.scheduler import PreemptingScheduler
from shared.config import Qwen3Config
from shared.generation import StopRule

CFG = Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64,
                  tie_word_embeddings=True, eos_token_ids=())
S = 2


def random_pool(num_blocks: int, seed: int = 0) -> BlockKvPool:
    """L3's device pool, every page of every layer's K and V filled with different random numbers."""
    pool = BlockKvPool(CFG, num_blocks, S, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return pool


def pages(pool, block: int) -> list[torch.Tensor]:
    """Block `block`'s pages in every layer, K then V."""
    return [t[block].clone() for t in pool.k + pool.v]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.task("L5.1")
def test_swap_out_copies_every_layer_and_swap_in_restores_it_elsewhere():
    device = random_pool(6)
    before = {b: pages(device, b) for b in range(6)}
    host = HostKvPool(device, 4)
    host_ids = host.swap_out([4, 1])
    assert len(host_ids) == 2 and len(set(host_ids)) == 2, f"swap_out of 2 device blocks returned host ids {host_ids}"
    assert host.allocator.num_free == 2, f"2 of 4 host blocks should be taken, {4 - host.allocator.num_free} are"
    for dev, h in zip([4, 1], host_ids):
        for i, (d_t, h_t) in enumerate(zip(device.k + device.v, host.k + host.v)):
            what = f"layer {i % 2}'s {'KV'[i // 2]}"
            assert torch.equal(h_t[h], d_t[dev]), f"host block {h} should hold device block {dev}'s pages ({what})"
    for t in device.k + device.v:
        t.zero_()  # the device blocks go to other requests meanwhile
    host.swap_in(host_ids, [0, 5, 3])  # a request readmitted with one more block than it swapped out
    assert same(pages(device, 0), before[4]), "device block 0 should get back what device block 4 held, in every layer"
    assert same(pages(device, 5), before[1]), "device block 5 should get back what device block 1 held, in every layer"
    assert not device.k[0][3].any(), "block 3 (reserved ahead, nothing swapped out for it) should be left alone"
    assert host.allocator.num_free == 4, "swap_in should give the host blocks back"


def scheduler(policy: str, num_blocks: int = 8, host_blocks: int | None = None):
    device = random_pool(num_blocks, seed=1)
    host = HostKvPool(device, host_blocks) if host_blocks else None
    return PreemptingScheduler(BlockAllocator(num_blocks), S, 64, policy, host, EngineStats()), device


def running(sched, seq_id: int, prompt: int, outputs: int = 0, cached: int | None = None, max_new: int = 8) -> Sequence:
    """A request admitted and fed: its prompt plus `outputs` generated tokens, `cached` of them in the pool."""
    seq = Sequence(list(range(1, prompt + 1)), S, seq_id=seq_id, stop=StopRule(max_new))
    seq.output_ids = [7] * outputs
    seq.reserve(seq.num_tokens, sched.allocator)
    seq.num_cached = seq.num_tokens - 1 if cached is None else cached
    seq.status = Status.RUNNING
    return seq


@pytest.mark.task("L5.2")
def test_preempt_by_recompute_drops_the_kv_and_queues_it_first():
    sched, _ = scheduler("recompute")
    queued = Sequence([1], S, seq_id=5)
    sched.waiting.append(queued)
    seq = running(sched, 0, prompt=5, outputs=2)  # 7 tokens, 6 cached, 4 blocks
    sched.preempt(seq)
    assert seq.blocks == [] and sched.allocator.num_free == 8, (
        f"a preempted request gives its blocks back; holds {seq.blocks}")
    assert seq.num_cached == 0, f"recompute drops the KV: num_cached should be 0, is {seq.num_cached}"
    assert seq.output_ids == [7, 7], "the tokens already generated stay: they are prefilled again with the prompt"
    assert seq.status is Status.WAITING and list(sched.waiting) == [seq, queued], (
        "the victim arrived before every queued request: it goes to the front of `waiting`")
    assert sched.stats.preemptions == 1, f"stats.preemptions is {sched.stats.preemptions}, want 1"


@pytest.mark.task("L5.2")
def test_preempt_by_swap_copies_only_the_blocks_in_use():
    sched, device = scheduler("swap", host_blocks=4)
    seq = running(sched, 0, prompt=3, cached=3)  # 3 tokens cached in 2 blocks of 2, and a 3rd block reserved ahead
    seq.reserve(5, sched.allocator)
    assert len(seq.blocks) == 3
    in_use = [pages(device, b) for b in seq.blocks[:2]]
    sched.preempt(seq)
    host_ids = seq.extra.get("host_blocks")
    assert host_ids is not None and len(host_ids) == 2, (
        f"seq.extra['host_blocks'] should name the 2 host blocks its 3 cached tokens were copied to, is {host_ids}")
    for i, h in enumerate(host_ids):
        assert same([t[h] for t in sched.host.k + sched.host.v], in_use[i]), (
            f"host block {h} should hold its block {i}'s pages")
    assert seq.num_cached == 3, "a swapped-out request keeps its KV (on the host): num_cached stays 3"
    assert seq.status is Status.SWAPPED and list(sched.swapped) == [seq], "a swapped-out request waits in `swapped`"
    assert seq.blocks == [] and sched.allocator.num_free == 8, "its device blocks, the spare one too, go back to the pool"
    assert (sched.stats.preemptions, sched.stats.swaps_out) == (1, 1)


@pytest.mark.task("L5.2")
def test_swap_falls_back_to_recompute_when_the_host_is_full():
    sched, _ = scheduler("swap", host_blocks=1)
    seq = running(sched, 0, prompt=4, cached=4)  # 2 blocks in use, the host holds 1
    sched.preempt(seq)
    assert seq.status is Status.WAITING and list(sched.waiting) == [seq] and not sched.swapped, (
        "with no room on the host the victim is recomputed: to `waiting`, not `swapped`")
    assert seq.num_cached == 0 and "host_blocks" not in seq.extra and sched.host.allocator.num_free == 1
    assert (sched.stats.preemptions, sched.stats.swaps_out) == (1, 0)


@pytest.mark.task("L5.3")
def test_admission_is_on_current_need_not_the_promise():
    sched, _ = scheduler("recompute")
    sched.running = [running(sched, 0, prompt=8)]  # holds 4 of 8 blocks
    seq = Sequence(list(range(1, 6)), S, seq_id=1, stop=StopRule(10))  # may grow to 14 tokens: 7 blocks
    sched.add(seq)
    sched.admit()
    assert [s.seq_id for s in sched.running] == [0, 1], (
        "a 5-token prompt needs 3 blocks now and 4 are free: L5 admits it (L4's promise, 8 + 7 blocks, would not)")
    assert len(seq.blocks) == 3 and seq.status is Status.RUNNING, f"admitted with its prompt's 3 blocks, holds {seq.blocks}"
    assert seq.admitted_at == sched.step_no


@pytest.mark.task("L5.3")
def test_the_oldest_queued_request_goes_first_across_both_queues():
    sched, device = scheduler("swap", num_blocks=8, host_blocks=2)
    a, b = running(sched, 1, prompt=3, cached=3), running(sched, 2, prompt=3, cached=3)
    c = running(sched, 3, prompt=5, cached=5)
    saved = [pages(device, blk) for blk in b.blocks[:2]]
    for s in (c, b, a):  # newest first, as schedule() evicts: c (3 blocks) does not fit the host, b does, a no longer
        sched.preempt(s)
    assert [s.seq_id for s in sched.waiting] == [1, 3] and list(sched.swapped) == [b]
    for t in device.k + device.v:
        t.zero_()
    sched.admit()
    assert [s.seq_id for s in sched.running] == [1, 2, 3], (
        f"admission takes the older head of `waiting` and `swapped` each time: want running [1, 2, 3], got "
        f"{[s.seq_id for s in sched.running]}")
    assert b.status is Status.RUNNING and "host_blocks" not in b.extra, "a swapped request admitted again is swapped in"
    assert all(same(pages(device, blk), saved[i]) for i, blk in enumerate(b.blocks[:2])), (
        "request 2's pages should be copied back from the host into its new device blocks")
    assert sched.host.allocator.num_free == 2 and sched.stats.swaps_in == 1


@pytest.mark.task("L5.3")
def test_a_head_that_does_not_fit_blocks_every_younger_request():
    sched, _ = scheduler("recompute", num_blocks=8)
    sched.running = [running(sched, 0, prompt=10)]  # holds 5 of 8 blocks: 3 free
    big = Sequence(list(range(1, 8)), S, seq_id=1, stop=StopRule(2))  # needs 4 blocks now
    small = Sequence([1], S, seq_id=2, stop=StopRule(2))  # needs 1: would fit, but arrived later
    sched.add(big)
    sched.add(small)
    sched.admit()
    assert [s.seq_id for s in sched.running] == [0] and [s.seq_id for s in sched.waiting] == [1, 2], (
        "the head (4 blocks needed, 3 free) waits, and nothing younger overtakes it, or the oldest could starve")

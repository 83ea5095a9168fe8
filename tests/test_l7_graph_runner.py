"""L7's static-buffer decode path on CPU: padded rows touch only the dummy block, no row keeps what a bigger
earlier step left in the buffers, each size is captured once and reused, and greedy tokens equal HF's."""
from __future__ import annotations

import pytest
import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l4_continuous.engine import Arrival
from lessons.l7_cuda_graphs import L7Engine
from lessons.l7_cuda_graphs.capture_sizes import default_capture_sizes, padded_size
from shared.errors import CourseError
from shared.generation import StopRule

S, BLOCKS = 4, 96


def stop(model, new: int) -> StopRule:
    return StopRule(new, frozenset(model.config.eos_token_ids), ignore_eos=True)


def engines(model, sizes=(1, 2, 4, 8)) -> tuple[L7Engine, L7Engine]:
    """The same pool and scheduler twice: one runs decode steps over the static buffers, one eagerly."""
    on = L7Engine(model, S, BLOCKS, 8, "torch", capture_sizes=list(sizes))
    off = L7Engine(model, S, BLOCKS, 8, "torch", graphs=False)
    return on, off


def outside_dummy(engine: L7Engine) -> list[torch.Tensor]:
    keep = torch.ones(engine.runner.pool.num_blocks, dtype=torch.bool)
    keep[engine.dummy_block] = False
    return [t[keep] for t in engine.runner.pool.k + engine.runner.pool.v]


def changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> torch.Tensor:
    """[blocks, S] bool: which slots any layer's K or V bytes changed in."""
    return torch.stack([(a != b).flatten(2).any(-1) for a, b in zip(before, after)]).any(0)


def step_both(on: L7Engine, off: L7Engine) -> None:
    """One step of each; outside the dummy block the padded step must change exactly the slots the eager step
    changes, to the same values. Same values up to rounding: a matmul over 4 rows may round a row differently
    than one over 3, so the bits of the real rows can differ; which bytes are written cannot."""
    before = [outside_dummy(on), outside_dummy(off)]
    on.step(), off.step()
    after = [outside_dummy(on), outside_dummy(off)]
    assert torch.equal(changed_slots(before[0], after[0]), changed_slots(before[1], after[1])), \
        "the padded step wrote a slot outside the dummy block that the eager step did not"
    # measured 6.0e-6 (Intel Xeon AMX; 0 on one thread), 1.3e-5 (torch capped to AVX2): 8x margin
    for a, b in zip(*after):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def eight_then_three(model, prompt_ids, on: L7Engine, off: L7Engine, steps: int = 5) -> tuple:
    """8 requests prefill together, decode one step at 8 rows; 5 then finish, and the next step has 3 rows,
    padded to 4. The pools are compared after every step (step_both)."""
    prompts = [[1000 + i] + prompt_ids[i % 4][:10] for i in range(8)]  # distinct first tokens: no cache hits
    seqs = []
    for e in (on, off):
        seqs.append([e.add_request(p, stop(model, 2 if i < 5 else 5)) for i, p in enumerate(prompts)])
    for _ in range(steps):  # 1: prefill; 2: 8 rows (5 finish); 3: 3 rows padded to 4; 4, 5: the same
        step_both(on, off)
    return [s.output_ids for s in seqs[0]], [s.output_ids for s in seqs[1]], prompts


@pytest.mark.task("L7.1")
def test_default_capture_sizes_and_padding():
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(6) == [1, 2, 4]
    assert [padded_size([1, 2, 4, 8], n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]


@pytest.mark.task("L7.6")
def test_padded_rows_write_only_the_dummy_block(tiny_model, prompt_ids):
    """3 requests padded to 4: outside the dummy block, the pool changes exactly where the eager step's does."""
    on, off = engines(tiny_model)
    for e in (on, off):
        for p in prompt_ids[:3]:
            e.add_request(p, stop(tiny_model, 4))
    dummy_before = on.runner.pool.k[0][on.dummy_block].clone()
    for _ in range(4):
        step_both(on, off)
    assert on.runner.replays == {4: 3} and on.runner.padded_rows == 3
    assert dummy_before.abs().sum() > 0, "capture's padded rows write the dummy block"
    assert off.runner.pool.k[0][off.dummy_block].abs().sum() == 0, "the eager engine never touches it"


@pytest.mark.task("L7.6")
def test_padded_rows_are_refilled_after_a_bigger_step(tiny_model, prompt_ids):
    """After a step of 8 rows, the step of 3 padded to 4 must rewrite row 3 of every buffer: left as it was,
    row 3 would write into (and read) the blocks of the request that sat there. Planted-bug test of the doc."""
    on, off = engines(tiny_model)
    eight_then_three(tiny_model, prompt_ids, on, off, steps=3)
    assert on.runner.replays == {8: 1, 4: 1}
    b, dummy, live = on.runner.buffers, on.dummy_block, on.scheduler.running
    assert b.input_ids[3] == 0 and b.positions[3] == 0 and b.slot_mapping[3] == dummy * S
    assert b.kv_indptr[4] - b.kv_indptr[3] == 1 and b.kv_indices[int(b.kv_indptr[3])] == dummy
    assert b.kv_last_page_len[3] == 1
    # rows 0..2 are exactly the real requests' metadata for the step just run
    fed = [Request(r.all_tokens()[: r.num_cached], S, blocks=r.blocks, num_cached=r.num_cached - 1) for r in live]
    want = BatchMeta.build(fed, S, torch.device("cpu"))  # the step as L3 would have built it, unpadded
    assert torch.equal(b.slot_mapping[:3], want.slot_mapping) and torch.equal(b.positions[:3], want.positions)
    assert torch.equal(b.kv_indptr[:4], want.kv_indptr) and torch.equal(b.kv_last_page_len[:3], want.kv_last_page_len)


def test_a_step_after_eight_rows_matches_hf(tiny_model, hf, prompt_ids):
    on, off = engines(tiny_model)
    got, eager, prompts = eight_then_three(tiny_model, prompt_ids, on, off)
    assert got == eager
    assert got == [hf.generate(p, stop(tiny_model, 2 if i < 5 else 5)).tokens for i, p in enumerate(prompts)]


@pytest.mark.task("L7.6")
def test_each_size_captured_once_reused_and_bigger_batches_run_eagerly(tiny_model, hf, prompt_ids):
    """Captured sizes 1, 2, 4. Arrivals grow the batch 1 -> 2 -> 3 -> 6 (above 4: eager); it shrinks to 2, 1."""
    engine = L7Engine(tiny_model, S, BLOCKS, 8, "torch", capture_sizes=[1, 2, 4])
    prompts = [[2000 + i] + prompt_ids[i % 4][:8] for i in range(6)]
    news = [12, 10, 8, 3, 3, 3]
    work = [Arrival(p, stop(tiny_model, n), step=s) for p, n, s in zip(prompts, news, [0, 3, 6, 9, 9, 9])]
    got = engine.run(work)
    r = engine.runner
    assert r.captures == {1: 1, 2: 1, 4: 1}, "every size is captured once, at construction"
    assert min(r.replays[s] for s in (1, 2, 4)) >= 2, "and replayed many times"
    assert r.eager_steps > 4, "the 4 prefill steps plus the decode steps of 6 rows"
    assert got == [hf.generate(p, stop(tiny_model, n)).tokens for p, n in zip(prompts, news)]
    assert engine.allocator.num_free == engine.usable_blocks


@pytest.mark.task("L7.1")
def test_bad_capture_sizes_are_refused(tiny_model):
    with pytest.raises(CourseError, match="capture size 9"):
        L7Engine(tiny_model, S, BLOCKS, 8, "torch", capture_sizes=[1, 9])


def test_the_dummy_block_is_not_part_of_what_a_request_may_hold(tiny_model):
    """--num-blocks 4 gives requests 4 blocks; the dummy block is a fifth that no request may count on."""
    engine = L7Engine(tiny_model, S, 4, 8, "torch")
    stop_rule = StopRule(4, frozenset(), ignore_eos=True)
    with pytest.raises(CourseError, match="the whole pool has 4"):
        engine.add_request(list(range(1, 15)), stop_rule)  # feeds 14 + 4 - 1 = 17 tokens: 5 blocks
    fits = engine.add_request(list(range(1, 14)), stop_rule)  # feeds 13 + 4 - 1 = 16 tokens: exactly 4 blocks
    while engine.scheduler.has_work():
        engine.step()
    assert len(fits.output_ids) == 4
    assert engine.allocator.num_free == engine.usable_blocks

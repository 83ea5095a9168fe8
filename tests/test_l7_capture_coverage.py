"""L7's graph bookkeeping as exact numbers: which sizes are captured, and which size every decode step replays.

A graph runner can capture a size twice, pad to the wrong size, or run eagerly a step it should replay,
and still emit HF's tokens (the eager path is correct, only slower). So: the captured sizes for every
max_running from 1 to 40 and for user lists with duplicates, unsorted; then scripted workloads whose every
decode batch size is known, with the exact replays per size, eager steps, real and padded rows, each
derived in a comment; then a decode batch of requests sharing cached prefix blocks through the buffers.
"""
from __future__ import annotations

import pytest

from lessons.l4_continuous.engine import Arrival
from lessons.l7_cuda_graphs import L7Engine
from shared.generation import StopRule
from test_l7_graph_runner import step_both, stop

S = 4

# Default sizes, written out: the sizes every max_running from `first` up (to the next row) captures.
# 1, 2, 4 and 8 once max_running reaches them, then one every 8 rows: 16, 24, 32, 40.
DEFAULT_SIZES = [
    (1, [1]),
    (2, [1, 2]),
    (4, [1, 2, 4]),
    (8, [1, 2, 4, 8]),
    (16, [1, 2, 4, 8, 16]),
    (24, [1, 2, 4, 8, 16, 24]),
    (32, [1, 2, 4, 8, 16, 24, 32]),
    (40, [1, 2, 4, 8, 16, 24, 32, 40]),
]


def default_sizes(max_running: int) -> list[int]:
    return [sizes for first, sizes in DEFAULT_SIZES if first <= max_running][-1]


def counters(engine: L7Engine) -> tuple:
    r = engine.runner
    return dict(r.replays), r.eager_steps, r.real_rows, r.padded_rows


@pytest.mark.task("L7.5")
def test_every_max_running_from_1_to_40_captures_each_default_size_once(tiny_model):
    for max_running in range(1, 41):
        engine = L7Engine(tiny_model, S, 8, max_running, "torch")
        want = default_sizes(max_running)
        assert engine.runner.sizes == want, f"max_running {max_running}"
        assert engine.runner.captures == {s: 1 for s in want}, f"max_running {max_running}: each size exactly once"
        assert counters(engine) == ({}, 0, 0, 0), "capture is not a step: nothing replayed, nothing padded yet"


@pytest.mark.task("L7.5")
@pytest.mark.parametrize("max_running,given,want", [
    (8, [8, 2, 2, 5], [2, 5, 8]),  # duplicates and unsorted: each size once, in order
    (5, [5, 1, 5, 1, 5], [1, 5]),
    (4, [4, 4, 4, 4], [4]),
    (3, [3], [3]),
    (4, [], []),  # an empty list: no graphs, every step eager
])
def test_user_sizes_are_sorted_deduplicated_and_captured_once(tiny_model, max_running, given, want):
    engine = L7Engine(tiny_model, S, 8, max_running, "torch", capture_sizes=given)
    assert engine.runner.sizes == want
    assert engine.runner.captures == {s: 1 for s in want}


@pytest.mark.task("L7.5")
def test_graphs_off_captures_nothing(tiny_model):
    engine = L7Engine(tiny_model, S, 8, 8, "torch", graphs=False, capture_sizes=[1, 2])
    assert engine.runner.sizes == [] and engine.runner.captures == {}


def shrinking_batch(model, max_running: int, sizes: list[int] | None, prompt_len: int = 2) -> L7Engine:
    """max_running requests, all submitted at step 0, request i (prompt_len tokens, the first distinct: no
    cache hits) asking for i + 1 new tokens. Step 1 prefills them all; request 0 then has its 1 token and
    finishes. Step j (2 .. max_running) is a decode step of the requests with more than j - 1 tokens to
    go: max_running + 1 - j rows. So the decode batches are max_running - 1, max_running - 2, ..., 1,
    each exactly once; blocks are plentiful, so nothing is preempted. With 2-token prompts the prefill
    step feeds 2 tokens a row: eager. With 1-token prompts every row of it feeds 1 token, which is a
    decode step's shape: it replays too, at the size that holds max_running rows."""
    need = sum(-(-(prompt_len + i) // S) for i in range(max_running))  # i feeds prompt_len + (i + 1) - 1 tokens
    engine = L7Engine(model, S, need, max_running, "torch", capture_sizes=sizes)
    work = [Arrival([3000 + i, 5][:prompt_len], StopRule(i + 1, frozenset(), ignore_eos=True))
            for i in range(max_running)]
    outputs = engine.run(work)
    assert [len(o) for o in outputs] == [i + 1 for i in range(max_running)]
    assert engine.stats.preemptions == 0 and engine.stats.steps == max_running
    assert engine.allocator.num_free == engine.usable_blocks
    return engine


@pytest.mark.task("L7.6")
def test_decode_batches_39_down_to_1_on_the_default_sizes(tiny_model):
    """max_running 40: sizes 1 2 4 8 16 24 32 40; decode batches 39 .. 1, one step each.
      39..33 -> 40: 7 steps, padded 1+2+..+7 = 28      32..25 -> 32: 8 steps, padded 0+1+..+7 = 28
      24..17 -> 24: 8 steps, padded 28                   16..9 -> 16: 8 steps, padded 28
      8..5 -> 8: 4 steps, padded 0+1+2+3 = 6             4, 3 -> 4: 2 steps, padded 1
      2 -> 2, 1 -> 1: 1 step each, padded 0
    Every decode step replays: eager is the one prefill step. Real rows 1+..+39 = 780; padded 28*4+6+1 = 119."""
    engine = shrinking_batch(tiny_model, 40, None)
    assert counters(engine) == ({40: 7, 32: 8, 24: 8, 16: 8, 8: 4, 4: 2, 2: 1, 1: 1}, 1, 780, 119)
    assert engine.runner.captures == {s: 1 for s in default_sizes(40)}, "replays never capture again"


@pytest.mark.task("L7.6")
def test_decode_batches_above_the_largest_size_run_eagerly(tiny_model):
    """max_running 12: the default sizes stop at 8. Decode batches 11 .. 1:
      11, 10, 9: above 8, eager (3 steps)    8..5 -> 8: 4 steps, padded 0+1+2+3 = 6
      4, 3 -> 4: 2 steps, padded 1           2 -> 2, 1 -> 1, padded 0
    Eager: the prefill + 3 = 4. Real rows (replayed steps only) 1+..+8 = 36; padded 7."""
    engine = shrinking_batch(tiny_model, 12, None)
    assert counters(engine) == ({8: 4, 4: 2, 2: 1, 1: 1}, 4, 36, 7)


@pytest.mark.task("L7.6")
def test_decode_batches_on_user_sizes_given_unsorted_with_a_duplicate(tiny_model):
    """max_running 8, sizes [8, 2, 2, 5] -> 2 5 8, 1-token prompts. The prefill step is 8 rows of 1 token:
    it replays at 8. Then the decode batches 7 .. 1:
      7, 6 -> 8: padded 1 + 2      5, 4, 3 -> 5: padded 0 + 1 + 2      2, 1 -> 2: padded 0 + 1
    So 8 replays 1 + 2 = 3 times, 5 three times, 2 twice; no eager step. Real rows 8 + (1+..+7) = 36;
    padded 0 + 3 + 3 + 1 = 7."""
    engine = shrinking_batch(tiny_model, 8, [8, 2, 2, 5], prompt_len=1)
    assert counters(engine) == ({8: 3, 5: 3, 2: 2}, 0, 36, 7)
    assert engine.runner.captures == {2: 1, 5: 1, 8: 1}


@pytest.mark.task("L7.6")
def test_requests_sharing_cached_prefix_blocks_decode_together(tiny_model, hf, prompt_ids):
    """S = 4, sizes 1 2 4 8. head = 8 tokens (2 blocks). A = head + 3 tokens (4 new), B = head + 1 and
    C = head + 1 other (3 new each), D = head + 2 (2 new).
      step 1: A alone, prefill 11 tokens: eager. Its 2 head blocks are registered.
      step 2: B and C arrive. Each looks (9-1)//4 = 2 blocks deep: both head blocks hit, 8 cached, and the
              one token left is fed as a 1-token step. A decodes. 3 rows of 1 token: a decode step, padded
              to 4 (1 padded row), and all 3 rows' page lists start with the same 2 head blocks.
      step 3: D arrives: (10-1)//4 = 2 deep, 8 cached, feeds 2 tokens: prefill tokens, eager.
      step 4: A, B, C, D decode: 4 rows -> size 4, no padding. Everyone has its tokens and finishes.
    Replays {4: 2}, eager 2, real rows 3 + 4 = 7, padded 1. Cached 3 * 8 = 24 of 11+9+9+10 = 39 tokens,
    15 computed: the runner is fed 11, 3, 1+1+1 + 2, 4 tokens, i.e. those 15 plus one per decode row (1+3+4).
    Every step, the pool outside the dummy block changes exactly as the eager engine's does."""
    head = prompt_ids[3][:8]
    prompts = [head + prompt_ids[0][:3], head + prompt_ids[1][:1], head + prompt_ids[2][:1], head + prompt_ids[1][1:3]]
    news = [4, 3, 3, 2]
    on = L7Engine(tiny_model, S, 64, 8, "torch", capture_sizes=[1, 2, 4, 8])
    off = L7Engine(tiny_model, S, 64, 8, "torch", graphs=False)
    seqs: list[list] = [[], []]
    fed: list[int] = []  # tokens the graph engine's runner really computes, per step
    forward = on.runner.forward

    def counted_forward(requests):
        fed.append(sum(r.num_tokens - r.num_cached for r in requests))
        return forward(requests)

    on.runner.forward = counted_forward

    def arrive(*which: int) -> None:
        for k, e in enumerate((on, off)):
            seqs[k] += [e.add_request(prompts[i], stop(tiny_model, news[i])) for i in which]

    arrive(0)
    step_both(on, off)
    arrive(1, 2)
    step_both(on, off)
    assert counters(on) == ({4: 1}, 1, 3, 1)
    b = on.runner.buffers  # still holding step 2's fill: rows A, B, C, then the padded row
    head_blocks = seqs[0][0].blocks[:2]
    for row in range(3):
        assert b.kv_indices[int(b.kv_indptr[row]):int(b.kv_indptr[row]) + 2].tolist() == head_blocks
    assert [s.blocks[:2] for s in seqs[0][:3]] == [head_blocks] * 3
    arrive(3)
    step_both(on, off)
    step_both(on, off)
    assert not on.scheduler.has_work() and not off.scheduler.has_work()
    assert counters(on) == ({4: 2}, 2, 7, 1)
    assert fed == [11, 3, 5, 4]
    for e in (on, off):
        assert (e.stats.prompt_tokens, e.stats.cached_tokens, e.stats.prefill_tokens) == (39, 24, 15)
        assert e.allocator.num_free == e.usable_blocks
    got = [s.output_ids for s in seqs[0]]
    assert got == [s.output_ids for s in seqs[1]]
    assert got == [hf.generate(p, stop(tiny_model, n)).tokens for p, n in zip(prompts, news)]

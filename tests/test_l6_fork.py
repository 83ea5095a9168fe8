"""Parallel sampling (n > 1) on the real tiny model: one prefill, n forks sharing every block, copy-on-write
before the first write into the shared partial block; each child equals its seed run alone."""
import hashlib

import pytest

from lessons.l4_continuous.engine import Arrival
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l5_preemption import L5Engine
from lessons.l6_prefix_sharing import L6Engine
from shared.generation import StopRule

SEED, N = 11, 3


def block_digest(pool, block: int) -> str:
    """A checksum of one block's rows in every layer, K and V."""
    h = hashlib.sha256()
    for rows in pool.k + pool.v:
        h.update(rows[block].contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.task("L6.7")
def test_a_write_after_a_fork_leaves_the_other_children_byte_identical(tiny_model, prompt_ids):
    prompt = prompt_ids[0]  # 5 tokens in blocks of 4: the last block is shared and partly filled
    engine = L6Engine(tiny_model, 4, 16, backend="torch")
    kids = engine.add_parallel(prompt, StopRule(4), SamplingParams(1.0, seed=SEED), n=N)
    engine.step()  # prefill once, fork, each child samples its first token
    assert all(k.blocks == kids[0].blocks for k in kids) and engine.allocator.ref[kids[0].blocks[-1]] == N
    pool = engine.runner.pool
    before = {k.seq_id: [block_digest(pool, b) for b in k.blocks] for k in kids}
    first, rest = kids[0], kids[1:]
    first.reserve(first.num_tokens, engine.allocator)  # copy-on-write: the next write lands in a shared block
    assert engine.stats.cow_copies == 1 and first.blocks[-1] != rest[0].blocks[-1]
    engine.runner.forward([first])  # writes position 5 into first's private copy only
    for k in rest:
        assert [block_digest(pool, b) for b in k.blocks] == before[k.seq_id]
    assert block_digest(pool, first.blocks[0]) == before[first.seq_id][0]  # full, still shared: untouched
    assert block_digest(pool, first.blocks[-1]) != before[first.seq_id][-1]


@pytest.mark.task("L6.7")
@pytest.mark.parametrize("block_size", [4, 5])  # 5: the 5-token prompt fills its block; nothing to copy
def test_each_child_equals_its_seed_alone(tiny_model, prompt_ids, block_size):
    prompt, stop = prompt_ids[0], StopRule(8, frozenset(tiny_model.config.eos_token_ids), ignore_eos=True)
    sampling = SamplingParams(0.8, top_k=50, seed=SEED)
    engine = L6Engine(tiny_model, block_size, 32, backend="torch")
    kids = engine.add_parallel(prompt, stop, sampling, n=N)
    while engine.scheduler.has_work():
        engine.step()
    for i, kid in enumerate(kids):
        alone = L5Engine(tiny_model, block_size, 32, backend="torch")
        want = alone.run([Arrival(prompt, stop, SamplingParams(0.8, top_k=50, seed=SEED + i))])[0]
        assert kid.output_ids == want, f"child {i}"
    assert len({tuple(k.output_ids) for k in kids}) > 1  # different seeds, different samples
    assert engine.stats.prefill_tokens == len(prompt)  # prefilled once
    assert engine.stats.cow_copies == (N - 1 if len(prompt) % block_size else 0)
    assert all(r == 0 for r in engine.allocator.ref)

"""Two promises of docs/l11_speculative.md that no other test holds, each pinned at the one step where it acts.

1. Drafts take their blocks only from free blocks nobody holds or caches (`SpecScheduler.draft_room`): when
   the pool's only free blocks are cached prefix blocks (ref 0, on the LRU), a decode drafts only into the room
   left in the blocks it already holds, and no cached prefix block is evicted for a draft.
2. `SpecStats` counts what verification decided (`L11Engine.commit`), before a stop cuts the output: with a stop
   id inside the accepted drafts, accepted, emitted and the per-position counts are the verdict's, not the
   length of the truncated output. Stop *strings* are matched by the server's engine loop after the step (L9),
   outside the engine, so they cannot reach these counters; only stop ids (EOS, `stop_token_ids`) are tested.

The replay drafter proposes L9's own greedy output (computed here), so the test decides which drafts are right.
"""
from __future__ import annotations

import pytest

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from lessons.l9_server.engine import L9Engine
from lessons.l11_speculative import L11Engine
from lessons.l11_speculative.replay import ReplayDrafter
from shared.generation import StopRule

K = 4
BLOCK = 4


def ignore_eos(model, new: int) -> StopRule:
    return StopRule(new, frozenset(model.config.eos_token_ids), ignore_eos=True)


def l9_output(model, prompt: list[int], stop: StopRule, sampling: SamplingParams = SamplingParams()) -> list[int]:
    return L9Engine(model, BLOCK, backend="torch").generate_batch([prompt], stop, sampling)[0]


# --- 1. drafts never evict a cached prefix block -----------------------------------------------------------------

CACHED_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks: both enter the prefix cache, then nobody holds them
PROMPT = [10, 20, 30, 40, 50]  # 5 tokens: after its prompt step 6 tokens in 2 blocks, room for 2 more in block 2
NEW = 8  # 5 + 8 tokens fit the 4-block pool


@pytest.mark.task("L11.7")
def test_drafts_never_evict_a_cached_prefix_block(tiny_model):
    """A 4-block pool: a first request fills 2 blocks with a cached prefix and finishes (both cached, ref 0); a
    second takes the other 2. Its first decode has n = 6 tokens in 2 blocks of 4, and every free block is a cached
    prefix block: the drafts get 2 * 4 - 6 = 2 positions (K = 4 asked), the table does not grow, nothing is
    evicted, and every cache entry from before the step names the same block with the same key afterwards."""
    expected = l9_output(tiny_model, PROMPT, ignore_eos(tiny_model, NEW))
    drafter = ReplayDrafter({tuple(PROMPT): expected}, tiny_model.config.vocab_size)
    engine = L11Engine(tiny_model, BLOCK, 4, backend="torch", drafter=drafter, num_speculative_tokens=K)
    alloc, cache = engine.allocator, engine.cache

    first = engine.add_request(CACHED_PROMPT, ignore_eos(tiny_model, 1))
    engine.step()
    assert first.status is Status.FINISHED
    cached = sorted(cache.entry)
    assert len(cached) == 2 and all(alloc.ref[b] == 0 for b in cached), \
        f"expected the first prompt's 2 blocks cached and unheld, got entries {cached}, refs {alloc.ref}"

    seq = engine.add_request(PROMPT, ignore_eos(tiny_model, NEW))
    engine.step()  # the prompt: 6 tokens in 2 blocks
    assert (seq.num_tokens, len(seq.blocks)) == (6, 2)
    assert alloc.num_free == alloc.num_cached_unheld == 2, \
        (f"expected the pool's only free blocks to be the 2 cached ones, got {alloc.num_free} free of which "
         f"{alloc.num_cached_unheld} cached")
    entries_before = dict(cache.entry)
    keys_before = {entry.key: block for block, entry in entries_before.items()}
    evictions_before, blocks_before = engine.stats.evictions, list(seq.blocks)

    engine.step()  # the first decode, with drafts
    lost = {b: e for b, e in entries_before.items() if cache.entry.get(b) != e}
    assert not lost, f"cached prefix blocks evicted or renamed by the drafts: {lost}; cache now {cache.entry}"
    assert all(cache.block_of.get(key) == block for key, block in keys_before.items()), \
        f"expected keys {keys_before} to name the same blocks, got {cache.block_of}"
    assert all(alloc.ref[b] == 0 and cache.is_cached(b) for b in cached), \
        f"expected blocks {cached} still cached and unheld, got refs {[alloc.ref[b] for b in cached]}"
    assert engine.stats.evictions == evictions_before, \
        f"expected no eviction, got {engine.stats.evictions - evictions_before}"
    assert engine.scheduler.limits == [2], \
        f"expected room for 2 drafts (2 blocks * 4 - 6 tokens; no unheld uncached block), got {engine.scheduler.limits}"
    assert engine.spec.drafted == 2, f"expected 2 drafts verified, got {engine.spec.drafted}"
    assert seq.blocks == blocks_before, f"expected the table to stay {blocks_before}, got {seq.blocks}"
    assert seq.output_ids == expected[:1 + 2 + 1], f"expected {expected[:4]}, got {seq.output_ids}"

    while engine.scheduler.has_work():
        engine.step()
    assert seq.output_ids == expected


# --- 2. the counters count the verdict, not the output a stop cut -----------------------------------------------

STOP_PROMPT = [10, 20, 30, 40, 50]
STOP_NEW = 16


def stop_position(expected: list[int]) -> int:
    """An output position inside the first verify row's drafts (positions 1 .. K) with drafts after it, whose
    token did not occur earlier in the output (so the request stops there and nowhere before)."""
    for p in range(2, K):
        if expected[p] not in expected[:p]:
            return p
    pytest.fail(f"no fresh token at output positions 2 .. {K - 1} of {expected}")


@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
@pytest.mark.parametrize("wrong", [None, K - 1], ids=["all-accepted", "last-draft-wrong"])
def test_counters_count_what_verification_decided_past_a_stop(tiny_model, how, wrong):
    """The first verify row carries K drafts of output positions 1 .. K; the stop token is the one at position p
    (2 or 3), so the output ends at p + 1 tokens, p of them from this row. Verification accepted K drafts (none
    wrong) or K - 1 (draft K - 1 wrong, past the stop): drafted, accepted, emitted and accepted_at count that
    verdict, not the p tokens the stop kept."""
    expected = l9_output(tiny_model, STOP_PROMPT, ignore_eos(tiny_model, STOP_NEW))
    p = stop_position(expected)
    token = expected[p]
    if how == "eos":
        stop, sampling = StopRule(STOP_NEW, frozenset({token}), ignore_eos=False), SamplingParams()
    else:
        stop, sampling = ignore_eos(tiny_model, STOP_NEW), SamplingParams(stop_token_ids=frozenset({token}))
    accepted = K if wrong is None else wrong
    drafter = ReplayDrafter({tuple(STOP_PROMPT): expected}, tiny_model.config.vocab_size,
                            lambda seq, pos: wrong is not None and pos == 1 + wrong)
    engine = L11Engine(tiny_model, BLOCK, backend="torch", drafter=drafter, num_speculative_tokens=K)
    seq = engine.add_request(STOP_PROMPT, stop, sampling)
    engine.step()
    finished = engine.step()
    assert finished == [seq] and seq.output_ids == expected[:p + 1], \
        f"expected the output cut at the stop, {expected[:p + 1]}, got {seq.output_ids} ({seq.status})"

    s = engine.spec
    got = {"verify_rows": s.verify_rows, "plain_rows": s.plain_rows, "drafted": s.drafted, "accepted": s.accepted,
           "emitted": s.emitted, "accepted_at": s.accepted_at}
    want = {"verify_rows": 1, "plain_rows": 0, "drafted": K, "accepted": accepted, "emitted": accepted + 1,
            "accepted_at": [1] * accepted}
    assert got == want, f"expected the verdict's counts {want} (the stop kept {p} of the row's tokens), got {got}"
    assert s.mean_accepted_length == accepted + 1, \
        f"expected mean accepted length {accepted + 1}, got {s.mean_accepted_length}"
    assert s.acceptance_rate == accepted / K, f"expected acceptance {accepted}/{K}, got {s.acceptance_rate}"

"""L6's statistics and admission steps as exact numbers, in small scenarios worked out by hand.

A prefix cache can lose hits, recompute what it could share or miscount, and still emit the right tokens:
parity cannot see it. So every scenario here states what each admission must be served from the cache,
what it must compute, and at which step it must be admitted, each number derived in a comment. They run
on the fake runner (tests/fake_runner.py): tokens are still checked against its reference, and every step
goes through test_l6_scheduler.Ledger, which checks the statistics against what the runner was fed.

Notation: S is the block size; k(t1..tn) is the chained key of the block ending a prefix t1..tn; match()
looks at most (num_tokens - 1) // S blocks deep (one token is always left to feed).
"""
import pytest

from fake_runner import FakeRunner, fake_model, reference
from lessons.l6_prefix_sharing import L6Engine
from shared.generation import StopRule
from test_l6_scheduler import Ledger


def engine(S: int, blocks: int, **kwargs) -> tuple[L6Engine, Ledger]:
    e = L6Engine(fake_model(), S, blocks, runner=FakeRunner(S, blocks), **kwargs)
    return e, Ledger(e)


def counts(e: L6Engine) -> tuple[int, int, int]:
    return e.stats.prompt_tokens, e.stats.cached_tokens, e.stats.prefill_tokens


def finish(e: L6Engine, ledger: Ledger) -> None:
    while e.scheduler.has_work():
        ledger.step()
    ledger.check_totals()
    assert all(r == 0 for r in e.allocator.ref) and e.allocator.num_free == e.allocator.num_blocks


@pytest.mark.task("L6.7")
def test_a_prompt_whose_blocks_repeat_each_other():
    """S = 2. P = 5 6 | 5 6 | 5 6 | 9: three blocks with the same tokens. Their keys are k(5 6),
    k(5 6 5 6), k(5 6 5 6 5 6): chained to the parent, so all different.

    P alone: the cache is empty and a block is registered only after the forward that wrote it, so P cannot
    hit its own earlier blocks: 0 cached, 7 computed. After it, 3 entries (3 distinct blocks), one per depth.
    Q = 5 6 5 6 5 6 | 8: looks (7-1)//2 = 3 blocks deep; all 3 are P's: 6 cached, 1 computed.
    R = 5 6 5 6 | 8: looks 2 deep: P's first 2 blocks: 4 cached, 1 computed.
    U = 5 6 5 6 5 6 5 6 | 7: looks 4 deep; the 4th key, k((5 6) x 4), was never registered (P stopped at 3):
    6 cached, 3 computed. A key of the block's tokens alone would make blocks 1.. collide with block 0: P would
    register 1 entry, and Q would be served 2 tokens, not 6."""
    e, ledger = engine(2, 16)
    prompts = {"P": [5, 6, 5, 6, 5, 6, 9], "Q": [5, 6, 5, 6, 5, 6, 8], "R": [5, 6, 5, 6, 8],
               "U": [5, 6, 5, 6, 5, 6, 5, 6, 7]}
    want = {"P": (7, 0, 7), "Q": (7, 6, 1), "R": (5, 4, 1), "U": (9, 6, 3)}  # (prompt, cached, computed) each
    seqs, total = {}, (0, 0, 0)
    for name, prompt in prompts.items():
        seqs[name] = e.add_request(prompt, StopRule(1))
        ledger.step()  # admitted at once (nothing in flight), prefilled, finished: 1 new token
        total = tuple(t + w for t, w in zip(total, want[name]))
        assert counts(e) == total, name
        assert seqs[name].admitted_at == e.clock
        if name == "P":
            p_table = e.runner.last_rows[0][3]
            entries = sorted(e.cache.prefix(b) for b in e.cache.entry)
            assert entries == [(5, 6), (5, 6, 5, 6), (5, 6, 5, 6, 5, 6)]
            assert sorted(e.cache.entry) == sorted(p_table[:3]), "one entry per depth, each in P's own block"
        if name == "Q":
            assert e.runner.last_rows[0][3][:3] == p_table[:3], "Q's hits are P's three blocks"
    assert total == (28, 16, 12)
    finish(e, ledger)
    for name, prompt in prompts.items():
        assert seqs[name].output_ids == reference(prompt, 1)


@pytest.mark.task("L6.7")
@pytest.mark.parametrize("wait", [True, False])
def test_same_step_arrivals_sharing_a_prefix(wait):
    """S = 2, max 2 new tokens each, all four submitted before step 1, in this order:
        A = 1 2 | 3 4 | 5        B = 1 2 | 3 4 | 6 7        C = 1 2 | 3 4 | 8        D = 9 9 | 9

    wait_for_inflight (the default):
      step 1: A is admitted (empty cache): 5 tokens, 0 cached, 5 computed. Its forward fills k(1 2) and
              k(1 2 3 4), so they are in flight. B's first block is k(1 2): in flight, so B waits (one step
              later it is a hit), and so does C; D, which shares nothing, passes them: 0 cached, 3 computed.
      step 2: A's two blocks are registered. B looks (6-1)//2 = 2 deep: 2 hits, 4 cached, 2 computed.
              C looks (5-1)//2 = 2 deep: 2 hits, 4 cached, 1 computed.
              Totals: 5+6+5+3 = 19 tokens, 8 cached, 11 computed. B and C hold A's first two blocks.
    without it: all four are admitted at step 1 and nothing is cached yet: 19 tokens, 0 cached, 19 computed;
              B and C compute the prefix again into blocks of their own."""
    e, ledger = engine(2, 16, wait_for_inflight=wait)
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [1, 2, 3, 4, 8], [9, 9, 9]]
    a, b, c, d = (e.add_request(p, StopRule(2)) for p in prompts)
    ledger.step()
    a_table = e.runner.last_rows[0][3]
    assert counts(e) == ((8, 0, 8) if wait else (19, 0, 19))
    ledger.step()
    assert counts(e) == ((19, 8, 11) if wait else (19, 0, 19))
    assert [s.admitted_at for s in (a, b, c, d)] == ([1, 2, 2, 1] if wait else [1, 1, 1, 1])
    tables = {row[0]: row[3] for row in e.runner.last_rows}
    if wait:  # B and C decode from A's blocks
        assert tables[b.seq_id][:2] == tables[c.seq_id][:2] == a_table[:2]
    else:  # three private copies of the prefix
        assert len({tables[s.seq_id][:2] for s in (a, b, c)}) == 3
    finish(e, ledger)
    assert counts(e) == ((19, 8, 11) if wait else (19, 0, 19))
    assert [s.output_ids for s in (a, b, c, d)] == [reference(p, 2) for p in prompts]


@pytest.mark.task("L6.7")
@pytest.mark.parametrize("wait", [True, False])
def test_a_block_a_running_request_completes_is_waited_for(wait):
    """S = 2. A = 1 2 | 3 (3 new tokens) runs alone at step 1: 3 tokens computed, k(1 2) registered, and
    it samples a1. Then B = 1 2 | 3 a1 | 7 arrives. At step 2, A's decode feeds a1 and completes its
    second block, k(1 2 3 a1), which is B's second block.
    wait_for_inflight: at step 2 B has 1 hit and its next key is in flight: it waits. At step 3 both blocks
        are cached: B is admitted with 4 cached and 1 computed. Totals 3+5 = 8, 4 cached, 4 computed.
    without it: B is admitted at step 2 with 1 hit: 2 cached, 3 computed. Totals 8, 2, 6."""
    e, ledger = engine(2, 16, wait_for_inflight=wait)
    a = e.add_request([1, 2, 3], StopRule(3))
    ledger.step()
    a1 = a.output_ids[0]
    b = e.add_request([1, 2, 3, a1, 7], StopRule(1))
    finish(e, ledger)
    assert (a.admitted_at, b.admitted_at) == ((1, 3) if wait else (1, 2))
    assert counts(e) == ((8, 4, 4) if wait else (8, 2, 6))
    assert a.output_ids == reference([1, 2, 3], 3) and b.output_ids == reference([1, 2, 3, a1, 7], 1)


@pytest.mark.task("L6.7")
def test_a_preempted_request_re_hits_its_own_blocks_generated_tokens_included():
    """S = 2, a pool of 5 blocks. A = 1 2 3 (3 new tokens), B = 7 8 9 (4 new), both submitted before step 1.
      step 1: both admitted, 2 blocks each (block 4 stays free): 6 tokens, 0 cached, 6 computed.
              Registered: A's k(1 2), B's k(7 8). Each samples its first token: a1, b1.
      step 2: both decode (A feeds a1, B feeds b1); A's k(1 2 3 a1) and B's k(7 8 9 b1) are registered.
      step 3: A (5 tokens) needs a third block and takes block 4; B (5 tokens) needs one too and none is
              free: B, the last arrival, is preempted (recompute). Its 2 blocks are cached, so they go to
              the LRU, not the free list. A decodes, reaches 3 new tokens and finishes.
      step 4: B is re-admitted with 5 tokens (3 prompt + b1 b2). It looks (5-1)//2 = 2 deep and both of
              its own blocks are still cached, the second one holding b1, a generated token: 4 cached,
              1 computed (b2). Nothing was evicted: a free block (A's partial third) was left for B.
    Totals: 3 + 3 + 5 = 11 tokens (a re-admission counts its generated tokens, as PrefixStats says),
    4 cached, 6 + 1 = 7 computed; 1 preemption, 0 evictions."""
    e, ledger = engine(2, 5)
    a = e.add_request([1, 2, 3], StopRule(3))
    b = e.add_request([7, 8, 9], StopRule(4))
    ledger.step()
    b_table = e.runner.last_rows[1][3]
    assert counts(e) == (6, 0, 6)
    ledger.step()
    ledger.step()
    assert e.stats.preemptions == 1 and b.blocks == [] and b.num_cached == 0
    ledger.step()
    assert b.admitted_at == 4 and counts(e) == (11, 4, 7)
    assert e.runner.last_rows == [(b.seq_id, 4, 5, b_table[:2] + (4,))], "B feeds b2 alone, after its own 2 blocks"
    finish(e, ledger)
    assert counts(e) == (11, 4, 7) and (e.stats.preemptions, e.stats.evictions, e.stats.cow_copies) == (1, 0, 0)
    assert a.output_ids == reference([1, 2, 3], 3) and b.output_ids == reference([7, 8, 9], 4)

"""L6's prefix sharing on the fake runner: seeded random workloads whose prompts share a few prefixes, in
pools small enough that eviction and preemption happen, some with n > 1, some with a colliding hash.

After every step: each block's reference count equals the number of block tables holding it; free +
held + cached-unreferenced = total, the three disjoint; every cache entry's tokens hash to its key and
equal what the pool holds in that block (the fake runner writes token ids as K/V); every running
request's written history is intact in the pool (a held block was never evicted or overwritten).
At the end: every request's tokens equal the reference, and every block is free or cached-unreferenced.

And the statistics are audited against what really happened (Ledger), step by step: the tokens the fake
runner was fed, the block tables it saw, the entries really dropped from the cache. Parity alone cannot see
a miscounted statistic: the tokens stay right.
"""
import random

import pytest

from fake_runner import FakeRunner, decode_k, decode_v, fake_model, reference
from lessons.l4_continuous.engine import Arrival
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from lessons.l5_preemption import L5Engine
from lessons.l6_prefix_sharing import L6Engine
from lessons.l6_prefix_sharing.prefix_cache import chain_keys, default_hash
from shared.generation import StopRule
from test_l4_scheduler import expected

HASHES = {"blake2b": default_hash, "always 0": lambda parent, tokens: 0, "3 buckets": lambda p, t: sum(t) % 3}


def pool_token(pool, block: int, offset: int) -> int:
    """The token every layer's K and V agree a slot holds (-1 never written: they disagree)."""
    seen = {decode_k(float(k[block, offset, 0, 0]), l) for l, k in enumerate(pool.k)}
    seen |= {decode_v(float(v[block, offset, 0, 0]), l) for l, v in enumerate(pool.v)}
    assert len(seen) == 1, f"block {block} offset {offset}: layers disagree {seen}"
    return int(seen.pop())


def check_shared_pool(engine) -> None:
    sched, m, S = engine.scheduler, engine.allocator, engine.block_size
    holders = [0] * m.num_blocks
    ids = [seq.seq_id for seq in sched.running]
    assert ids == sorted(ids), f"running is not in arrival order (forked siblings included): {ids}"
    assert len(ids) <= sched.max_running, f"{len(ids)} running, max_running {sched.max_running} (siblings count)"
    for seq in sched.running:
        assert seq.status is Status.RUNNING
        assert len(set(seq.blocks)) == len(seq.blocks), "a table holds one block twice"
        for b in seq.blocks:
            holders[b] += 1
        tokens = seq.prompt_ids + seq.output_ids
        for p in range(seq.num_cached):  # its written history is intact: nothing it holds was reused
            assert pool_token(m.pool, seq.blocks[p // S], p % S) == tokens[p], f"request {seq.seq_id} lost position {p}"
    for seq in sched.waiting:
        assert seq.blocks == [], f"waiting request {seq.seq_id} holds blocks"
    assert holders == m.ref, "a reference count differs from the number of tables holding the block"
    free, lru, held = set(m._free), set(m._lru), {b for b in range(m.num_blocks) if m.ref[b]}
    assert len(free) == len(m._free) and not (free & lru) and not (held & (free | lru))
    assert len(free) + len(lru) + len(held) == m.num_blocks, "a block is in no state: leaked"
    assert all(m.cache.is_cached(b) for b in lru) and not any(m.cache.is_cached(b) for b in free)
    for b, entry in m.cache.entry.items():
        key, prefix = entry.key, m.cache.prefix(b)
        assert m.cache.block_of[key] == b and entry.ident[0] == b
        assert [pool_token(m.pool, b, o) for o in range(S)] == list(entry.tokens), f"cached block {b} holds other tokens"
        if prefix is None:  # an entry up its chain was evicted: no lookup reaches it (each needs its parent's)
            continue
        assert len(prefix) % S == 0 and chain_keys(list(prefix), [], S, len(prefix) // S, m.cache.hash_fn)[-1] == key


def solo(arrival: Arrival, seed: int) -> list[int]:
    """The prompt alone on L5 with this seed: what child seed - arrival.sampling.seed must give."""
    need = len(arrival.prompt_ids) + arrival.stop.max_new_tokens
    eng = L5Engine(fake_model(), 1, need, runner=FakeRunner(1, need))
    s = arrival.sampling
    return eng.run([Arrival(arrival.prompt_ids, arrival.stop, SamplingParams(s.temperature, seed=seed))])[0]


def shared_workload(rng: random.Random, n: int, S: int, cap: int, span: int) -> list[tuple[Arrival, int]]:
    prefixes = [[rng.randrange(64) for _ in range(rng.randint(0, 3 * S))] for _ in range(3)]
    out = []
    for _ in range(n):
        prompt = (rng.choice(prefixes) + [rng.randrange(64) for _ in range(rng.randint(0, S + 1))])[: cap - 1] or [7]
        new = rng.randint(1, max(1, min(8, cap - len(prompt))))
        stop = StopRule(new, frozenset({rng.randrange(64)}), ignore_eos=rng.random() < 0.5)
        k = rng.choice([1, 1, 1, 2, 3])
        sampling = SamplingParams(1.0, seed=rng.randrange(1000)) if k > 1 else SamplingParams()
        out.append((Arrival(prompt, stop, sampling, rng.randint(0, span)), k))
    return out


class Ledger:
    """Counts, outside the scheduler, what its statistics claim, and checks them after every step.

    A forward row whose request was not running before the step is an admission (a re-admission after
    preemption included: a preempted request waits at least one step). Its first position fed is what the
    cache served, its last what the admission needed in KV, the difference what was computed: so per step
    prompt_tokens grows by the admissions' token counts, cached_tokens by their first positions,
    prefill_tokens by the tokens the runner was really fed for them. Every other row is a request that was
    running before: it must feed exactly its one new token, and a block of its table replaced in place (its
    old table against the one the runner saw) is one copy-on-write. An eviction is an entry really removed
    from the cache (counted by wrapping the cache's drop).
    """

    def __init__(self, engine):
        self.engine, self.drops, self.decode_rows = engine, 0, 0
        cache, drop = engine.cache, engine.cache.drop

        def counted_drop(block: int) -> None:
            before = len(cache)
            drop(block)
            self.drops += before - len(cache)

        cache.drop = counted_drop

    def counters(self) -> tuple[int, ...]:
        s = self.engine.stats
        return s.prompt_tokens, s.cached_tokens, s.prefill_tokens, s.cow_copies, s.evictions

    def step(self) -> None:
        e, runner = self.engine, self.engine.runner
        tables = {seq.seq_id: tuple(seq.blocks) for seq in e.scheduler.running}
        was, drops, forwards = self.counters(), self.drops, runner.forwards
        e.step()
        rows = runner.last_rows if runner.forwards > forwards else []
        admitted = [row for row in rows if row[0] not in tables]
        running = [row for row in rows if row[0] in tables]
        assert all(end - first == 1 for _, first, end, _ in running), \
            f"a running request fed more than its 1 new token: {running}"
        copies = sum(old != new for seq_id, _, _, table in running for old, new in zip(tables[seq_id], table))
        real = (sum(end for _, _, end, _ in admitted), sum(first for _, first, _, _ in admitted),
                sum(end - first for _, first, end, _ in admitted), copies, self.drops - drops)
        counted = tuple(now - before for now, before in zip(self.counters(), was))
        assert counted == real, f"step {e.clock}: stats moved by (prompt, cached, prefill, cow, evictions) = " \
                                f"{counted}; what happened: {real}"
        self.decode_rows += len(running)

    def check_totals(self) -> None:
        s, runner = self.engine.stats, self.engine.runner
        assert s.prompt_tokens == s.cached_tokens + s.prefill_tokens
        assert runner.tokens_fed == s.prefill_tokens + self.decode_rows, "the runner computed other tokens"


def drive(engine, workload: list[tuple[Arrival, int]]) -> list[list]:
    groups, k = {}, 0
    order = sorted(range(len(workload)), key=lambda i: workload[i][0].step)
    ledger = Ledger(engine)
    for _ in range(5_000):
        while k < len(order) and workload[order[k]][0].step <= engine.clock:
            a, n = workload[order[k]]
            groups[order[k]] = engine.add_parallel(a.prompt_ids, a.stop, a.sampling, n)
            k += 1
        if k == len(order) and not engine.scheduler.has_work():
            break
        ledger.step()
        check_shared_pool(engine)
    else:
        raise AssertionError("the engine did not finish: a hang")
    ledger.check_totals()
    return [groups[i] for i in range(len(workload))]


def run_one(seed: int, hash_name: str) -> L6Engine:
    rng = random.Random(seed)
    S = rng.choice([1, 2, 3, 4])
    num_blocks = rng.randint(5, 12)
    engine = L6Engine(fake_model(), S, num_blocks, max_running=rng.randint(2, 6), runner=FakeRunner(S, num_blocks),
                      hash_fn=HASHES[hash_name], wait_for_inflight=seed % 3 != 0)
    workload = shared_workload(rng, rng.randint(3, 7), S, num_blocks * S, span=rng.randint(0, 8))
    for (a, n), group in zip(workload, drive(engine, workload)):
        for i, seq in enumerate(group):
            assert seq.status is Status.FINISHED
            want = expected(a) if n == 1 else solo(a, a.sampling.seed + i)
            assert seq.output_ids == want, f"request {seq.seq_id} (child {i} of {n})"
    assert all(r == 0 for r in engine.allocator.ref) and engine.allocator.num_free == num_blocks
    return engine


@pytest.mark.parametrize("batch", range(25))
def test_random_shared_prefix_workloads(batch):
    """8 workloads per case, 200 in all; every 4th with a colliding hash."""
    totals = dict(hit=0, evictions=0, preemptions=0, cow=0)
    for j in range(8):
        seed = batch * 8 + j
        e = run_one(seed, ["blake2b", "blake2b", "always 0", "3 buckets"][seed % 4])
        totals["hit"] += e.stats.cached_tokens
        totals["evictions"] += e.stats.evictions
        totals["preemptions"] += e.stats.preemptions
        totals["cow"] += e.stats.cow_copies
    assert totals["hit"] > 0  # the workloads exercise what they claim


def test_the_suite_exercises_evictions_preemptions_and_copies():
    totals = [0, 0, 0, 0]
    for seed in range(40):
        s = run_one(seed, "blake2b").stats
        for i, v in enumerate((s.cached_tokens, s.evictions, s.preemptions, s.cow_copies)):
            totals[i] += v
    assert all(totals), f"hits, evictions, preemptions, copies = {totals}"


@pytest.mark.task("L6.7")
def test_a_hit_reuses_the_block_and_feeds_only_the_tail():
    S = 2
    engine = L6Engine(fake_model(), S, 8, runner=FakeRunner(S, 8))
    a = engine.add_request([1, 2, 3, 4, 5], StopRule(1))
    engine.step()  # a finishes; its two full blocks stay cached
    b = engine.add_request([1, 2, 3, 4, 9, 9], StopRule(2))
    engine.step()
    assert engine.stats.cached_tokens == 4 and engine.stats.prefill_tokens == 5 + 2
    while engine.scheduler.has_work():
        engine.step()
    assert a.output_ids == reference([1, 2, 3, 4, 5], 1) and b.output_ids == reference([1, 2, 3, 4, 9, 9], 2)


@pytest.mark.task("L6.7")
def test_eviction_takes_the_least_recently_released_cached_block():
    S = 1
    engine = L6Engine(fake_model(), S, 4, runner=FakeRunner(S, 4))
    engine.add_request([1, 2], StopRule(1))
    engine.step()  # blocks 0, 1 cached (1 released first: tail first)
    engine.add_request([5, 6], StopRule(1))
    engine.step()  # takes the two never-used blocks 2, 3
    m = engine.allocator
    assert list(m._lru) == [1, 0, 3, 2] and engine.stats.evictions == 0
    engine.add_request([8, 9, 10], StopRule(1))
    engine.step()
    assert engine.stats.evictions == 3  # 1, 0, 3: released longest ago; 2 survives
    assert list(m._lru) == [2, 3, 0, 1]  # the new request's blocks, released tail first

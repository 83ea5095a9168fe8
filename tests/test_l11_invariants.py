"""L11's bookkeeping after every step of randomized workloads (seeded, so a failure replays).

Each seed draws a workload: prompts of random lengths (some sharing a prefix with an earlier one, so the cache
is hit), arrival steps, max tokens, greedy and seeded sampled requests, a fork (n = 2 or 3), K, the token
budget, the block size, and a pool a few blocks above the largest request (so decodes preempt each other).
Requests are aborted between steps at random. The drafter replays L9's output with random corruptions.
After every step:
- every running request: num_cached < num_tokens, and a request that sampled in the step (a decode, or a
  prompt's last slice) has num_cached == num_tokens - 1 (the pool holds every committed token but the last);
  its table holds at least the blocks of its cached tokens and none past blocks_for(num_tokens); a request
  not running holds no block;
- every block is free (ref 0, uncached, on the free list), cached and unheld (ref 0, on the LRU), or held
  with ref == the number of tables holding it (L7's dummy block counts as one);
- every prefix-cache entry names a verified prefix: its tokens are a whole number of blocks, its key is that
  prefix's hash chain, it is a prefix of some request's committed tokens (never a draft's), and a running
  request holding the block at table index i has those tokens as its first (i+1)*S, all of them cached.
At the end: every block free or cached (nothing leaked), each cached block's K/V equals what a fresh runner
writes for its prefix, and every output equals L9's (an aborted one is a prefix of it).
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from lessons.l2_token_flat.engine import blocks_for
from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.runner import PagedRunner
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from lessons.l6_prefix_sharing.prefix_cache import chain_keys
from lessons.l9_server.engine import L9Engine
from lessons.l11_speculative import L11Engine
from lessons.l11_speculative.replay import ReplayDrafter, wrong_with_rate
from shared.generation import StopRule

SEEDS = range(8)


def draw_workload(rng: random.Random, vocab: int) -> dict:
    """A random workload: the engine's shape and a list of (arrival step, prompt, stop, sampling, n)."""
    block_size = rng.choice([1, 2, 4, 8, 16])
    requests, prompts = [], []
    for _ in range(rng.randint(5, 9)):
        if prompts and rng.random() < 0.35:  # an earlier prompt's start, then tokens of its own
            base = rng.choice(prompts)
            prompt = base[:rng.randint(1, len(base))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        if prompt in prompts:
            continue  # the replay drafter is keyed by prompt
        prompts.append(prompt)
        stop = StopRule(rng.randint(1, 20), frozenset(), ignore_eos=True)
        n = 1
        if rng.random() < 0.3:
            sampling = SamplingParams(temperature=0.8, top_k=20, seed=rng.randrange(1000))
            if rng.random() < 0.5:
                n = rng.choice([2, 3])
        else:
            sampling = SamplingParams()
        requests.append((rng.randint(0, 15), prompt, stop, sampling, n))
    largest = max(blocks_for(len(p) + s.max_new_tokens, block_size) for _, p, s, _, _ in requests)
    return {"block_size": block_size, "k": rng.choice([1, 2, 4, 8]), "budget": rng.choice([1, 3, 5, 8, 16, 64]),
            "num_blocks": largest + rng.randint(0, 2) * (1 + 8 // block_size), "requests": requests,
            "abort_rate": rng.choice([0.0, 0.05, 0.1])}


def reference_outputs(model, w: dict) -> dict[int, list[int]]:
    """L9 (no drafts, no aborts) on the same workload: output per request id (a fork's n ids in a row)."""
    engine = L9Engine(model, w["block_size"], w["num_blocks"], backend="torch", max_batched_tokens=w["budget"])
    seqs = drive(engine, w, random.Random(0), abort_rate=0.0)
    return {s.seq_id: s.output_ids for s in seqs}


def drive(engine, w: dict, rng: random.Random, abort_rate: float, after_step=None) -> list:
    """Submit each request at its step, abort single requests at random between steps, step until done."""
    pending = sorted(w["requests"], key=lambda r: r[0])
    seqs, step = [], 0
    while pending or engine.scheduler.has_work():
        while pending and pending[0][0] <= step:
            _, prompt, stop, sampling, n = pending.pop(0)
            seqs += engine.add_parallel(prompt, stop, sampling, n)
        live = [s for s in seqs if s.status is not Status.FINISHED and "forks" not in s.extra
                and s.sampling.greedy]  # a fork's parent may not be aborted alone before it forks
        if live and rng.random() < abort_rate:
            victim = rng.choice(live)
            engine.abort([victim])
            victim.extra["aborted"] = True
        plan = record_plan(engine)
        engine.step()
        if after_step is not None:
            after_step(engine, seqs, plan)
        step += 1
    return seqs


def record_plan(engine) -> list:
    """The slices the step's forward gets, once it runs (the engine's runner is wrapped for one call)."""
    seen: list = []
    runner = engine.runner
    inner = type(runner).forward

    def forward(slices):
        seen.extend(slices)
        del runner.forward  # the class's method again
        return inner(runner, slices)

    runner.forward = forward
    return seen


def check_step(engine, seqs: list, plan: list) -> None:
    sched, alloc, S = engine.scheduler, engine.allocator, engine.block_size
    assert max(engine.step_tokens[-1:], default=0) <= engine.max_batched_tokens, (
        f"the step fed {engine.step_tokens[-1]} tokens, over the budget of {engine.max_batched_tokens} (drafts count)")
    running = list(sched.running)
    sampled = {id(p.seq) for p in plan if p.samples}
    for seq in running:
        assert seq.status is Status.RUNNING
        assert 0 <= seq.num_cached < seq.num_tokens, (
            f"request {seq.seq_id}: num_cached {seq.num_cached} of {seq.num_tokens} tokens (the last is never cached)")
        if id(seq) in sampled:  # a decode (with or without drafts) or a prompt's last slice
            assert seq.num_cached == seq.num_tokens - 1, (
                f"request {seq.seq_id} sampled this step: num_cached {seq.num_cached}, want {seq.num_tokens - 1} "
                f"(every committed token but the last; rejected drafts rolled back)")
        assert blocks_for(seq.num_cached, S) <= len(seq.blocks) <= blocks_for(seq.num_tokens, S), \
            (f"request {seq.seq_id}: {len(seq.blocks)} blocks for {seq.num_cached} cached of {seq.num_tokens} tokens "
             f"(blocks of {S})")
    for seq in seqs:
        if seq.status is not Status.RUNNING:
            assert seq.blocks == [] and seq not in running

    # Every block free, cached and unheld, or held by exactly ref tables.
    tables = Counter(b for seq in running for b in seq.blocks)
    tables[engine.dummy_block] += 1
    free, lru = list(alloc._free), list(alloc._lru)
    assert len(set(free)) == len(free) and not set(free) & set(lru), "a block twice on the free lists"
    for b in range(alloc.num_blocks):
        assert alloc.ref[b] == tables[b], f"block {b}: ref {alloc.ref[b]}, in {tables[b]} table(s) (leaked or lost)"
        if alloc.ref[b] == 0:
            assert (b in lru) == engine.cache.is_cached(b) and (b in free) != (b in lru), f"block {b} lost"
    assert alloc.num_free == len(free) + len(lru)

    # Every cache entry: a whole number of blocks of committed tokens, keyed by its own hash chain.
    streams = [seq.all_tokens() for seq in seqs]
    held_at = {}
    for seq in running:
        for i, b in enumerate(seq.blocks):
            held_at.setdefault(b, []).append((seq, i))
    for block, entry in engine.cache.entry.items():
        key, prefix = entry.key, engine.cache.prefix(block)
        if prefix is None:  # an entry up its chain was evicted: no lookup reaches it (each needs its parent's)
            assert len(entry.tokens) == S, f"cached block {block}: {len(entry.tokens)} tokens, not one block"
            continue
        assert prefix and len(prefix) % S == 0, f"cached block {block}: {len(prefix)} tokens, not whole blocks"
        assert engine.cache.block_of[key] == block, f"cached block {block}: its key names another block"
        assert chain_keys(list(prefix), [], S, len(prefix) // S, engine.cache.hash_fn)[-1] == key, \
            f"cached block {block}: its key is not the hash chain of its {len(prefix)} tokens (keyed from other tokens)"
        assert any(len(t) >= len(prefix) and tuple(t[:len(prefix)]) == prefix for t in streams), \
            f"block {block}: its prefix is no request's committed tokens"
        for seq, i in held_at.get(block, []):
            end = (i + 1) * S
            assert len(prefix) == end and tuple(seq.all_tokens()[:end]) == prefix, \
                f"cached block {block}: not the tokens request {seq.seq_id} holds it for (table index {i})"
            assert end <= seq.num_cached, f"block {block} cached before request {seq.seq_id} verified it"


def check_cached_kv(engine, model) -> None:
    """Each cached block holds the K/V a fresh runner writes for its prefix (prefixes of one chain share a run)."""
    S = engine.block_size
    entries = sorted(((b, p) for b in engine.cache.entry if (p := engine.cache.prefix(b)) is not None),
                     key=lambda e: -len(e[1]))  # an entry whose parent was evicted is never hit: not checked
    runs: list[tuple[tuple[int, ...], PagedRunner]] = []
    for block, prefix in entries:
        ref = next((r for p, r in runs if p[:len(prefix)] == prefix), None)
        if ref is None:
            ref = PagedRunner(model, S, len(prefix) // S, backend="torch")
            ref.forward([Request(list(prefix), S, blocks=list(range(len(prefix) // S)))])
            runs.append((prefix, ref))
        i = len(prefix) // S - 1
        # measured 3.1e-5 (Intel Xeon AMX), 1.9e-5 (torch capped to AVX2): 4.6x margin
        for mine, theirs in zip(engine.runner.pool.k + engine.runner.pool.v, ref.pool.k + ref.pool.v):
            torch.testing.assert_close(mine[block], theirs[i], atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"cached block {block} ({len(prefix)} tokens): {m}")


def run_checked(model, seed: int) -> dict:
    """One seed's workload on L11, checked after every step and at the end; what it exercised."""
    rng = random.Random(seed)
    w = draw_workload(rng, model.config.vocab_size)
    want = reference_outputs(model, w)
    expected, first_id = {}, 0
    for _, prompt, _, _, n in sorted(w["requests"], key=lambda r: r[0]):  # ids in submission order, as drive()
        expected[tuple(prompt)] = want[first_id]  # a fork's drafts replay its first child's sample
        first_id += n
    drafter = ReplayDrafter(expected, model.config.vocab_size, wrong_with_rate(0.3, seed))
    engine = L11Engine(model, w["block_size"], w["num_blocks"], backend="torch", max_batched_tokens=w["budget"],
                       drafter=drafter, num_speculative_tokens=w["k"])
    seqs = drive(engine, w, rng, w["abort_rate"], check_step)
    aborted = [s for s in seqs if s.extra.get("aborted")]
    for seq in seqs:
        if seq in aborted:
            assert seq.output_ids == want[seq.seq_id][:len(seq.output_ids)], (
                f"aborted request {seq.seq_id}: its output is not a prefix of L9's")
        else:
            assert seq.output_ids == want[seq.seq_id], f"request {seq.seq_id}: its output is not L9's"
    held = [b for b, r in enumerate(engine.allocator.ref) if r]
    assert engine.allocator.num_free == engine.usable_blocks and held == [engine.dummy_block], (
        f"at the end {engine.allocator.num_free} of {engine.usable_blocks} blocks are free or cached, and blocks "
        f"{held} are held: only L7's dummy block {engine.dummy_block} should be (the rest leaked)")
    check_cached_kv(engine, model)
    return {"k": w["k"], "block_size": w["block_size"], "budget": w["budget"], "accepted": engine.spec.accepted,
            "rejected": engine.spec.drafted - engine.spec.accepted, "preemptions": engine.stats.preemptions,
            "cached_tokens": engine.stats.cached_tokens, "cow_copies": engine.stats.cow_copies,
            "aborts": len(aborted), "forks": sum(n > 1 for *_, n in w["requests"]), "cached_blocks": len(engine.cache)}


RAN: dict[int, dict] = {}  # seed -> what its run exercised (filled by the per-seed tests)


@pytest.mark.task("L11.7")
@pytest.mark.parametrize("seed", SEEDS)
def test_every_step_keeps_the_invariants(tiny_model, seed):
    RAN[seed] = run_checked(tiny_model, seed)


def test_the_seeds_cover_what_they_are_for(tiny_model):
    """Across the seeds the workloads did what they are for: drafts kept and rejected, preemptions, cache hits,
    copy-on-write after forks, aborts, cached blocks whose K/V was compared, every K, blocks of 1, 4 and 16,
    budgets of 1 and above. (A seed not run above, under -k, runs here.)"""
    runs = [RAN[seed] if seed in RAN else run_checked(tiny_model, seed) for seed in SEEDS]
    total = Counter()
    for run in runs:
        total.update({k: v for k, v in run.items() if k not in ("k", "block_size", "budget")})
    assert {r["k"] for r in runs} == {1, 2, 4, 8}
    assert {1, 4, 16} <= {r["block_size"] for r in runs}
    assert 1 in {r["budget"] for r in runs} and max(r["budget"] for r in runs) == 64
    for what in ("accepted", "rejected", "preemptions", "cached_tokens", "cow_copies", "aborts", "forks",
                 "cached_blocks"):
        assert total[what] > 0, f"no seed exercised {what}: {runs}"

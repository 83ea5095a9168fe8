"""L8's chunked scheduler on the model-free fake runner (tests/fake_runner.py): seeded random workloads, and
a few exact schedules.

Random workloads (block sizes 1-8, pools small enough to preempt, budgets 1-40, an optional per-slice cap,
1-6 running, staggered arrivals, shared prefixes and duplicate prompts, greedy) are driven step by step,
and every plan the scheduler returns is audited before and after the forward (`Audit`):
  - a step's tokens never exceed the budget, and no prompt slice exceeds max_slice_tokens (or, with a
    long-prompt limit, its threshold); at most max_long_prefills long prompts are part-way through;
  - decodes first: if a running decode was left out, no prompt slice ran and decodes used the whole budget;
  - fair rotation: a decode left out was fed no less long ago than every decode fed (ties: the older first);
  - no idle budget: a step below the budget fed every running request; a step with work is never empty;
  - a slice starts at its request's computed count and stops at or before its token count; it samples
    exactly when it reaches the end, and a slice stopping inside the tokens samples nothing;
  - computed counts never pass token counts; every running request's written history is intact in the pool;
    reference counts equal the tables holding each block; nobody's table ever holds L7's dummy block;
  - engine.step_tokens is what the runner really computed; prompt_slices and timing match the plans.
At the end every request's tokens equal the reference, every block is free or cached, and no reference is
held but the dummy block's one.
"""
import random

import pytest

from fake_runner import FakeChunkRunner, FakeRunner, fake_model
from lessons.l2_token_flat.engine import blocks_for
from lessons.l4_continuous.engine import Arrival
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from lessons.l6_prefix_sharing import L6Engine
from lessons.l8_chunked_prefill import L8Engine
from shared.errors import CourseError
from shared.generation import StopRule
from test_l4_scheduler import expected
from test_l6_scheduler import HASHES, pool_token, solo


class FakeL8(L8Engine):
    runner_class = FakeChunkRunner


def fake_l8(block_size: int, num_blocks: int, **kwargs) -> FakeL8:
    return FakeL8(fake_model(), block_size, num_blocks, graphs=False, **kwargs)


def is_decode(seq) -> bool:
    """A running request that has sampled before and is one token behind (the scheduler's definition)."""
    return seq.status is Status.RUNNING and seq.num_tokens - seq.num_cached == 1 and bool(seq.output_ids)


class Audit:
    """Wraps the engine's scheduler.schedule to check each plan as it is returned (before the forward
    advances its slices), and checks the step's effects after engine.step(). Counts what the run exercised."""

    def __init__(self, engine):
        self.engine = engine
        self.budget, self.cap = engine.max_batched_tokens, engine.scheduler.slice_cap
        self.last_fed: dict[int, int] = {}  # seq_id -> the latest step whose plan held a slice of it
        self.slices: dict[int, int] = {}  # seq_id -> prompt slices seen
        self.rows: list[tuple] = []  # the current plan: (seq, start, end, decode, samples)
        self.seen = dict(left_out=0, multi_slice=0, capped=0, one_token_prompt=0, mixed=0, unsampled=0)
        sched, schedule = engine.scheduler, engine.scheduler.schedule

        def audited():
            decodes = [s for s in sched.running if is_decode(s)]
            had_work = sched.has_work()
            plan = schedule()
            self.check_plan(plan, decodes, had_work)
            return plan

        sched.schedule = audited

    def check_plan(self, plan, decodes, had_work) -> None:
        e, sched, step = self.engine, self.engine.scheduler, self.engine.scheduler.step_no
        assert plan or not had_work, f"step {step}: work to do and an empty plan (a stall)"
        self.rows = [(p.seq, p.num_cached, p.num_tokens, p.decode, p.samples) for p in plan]
        seqs = [p.seq for p in plan]
        assert len({id(s) for s in seqs}) == len(seqs), f"step {step}: a request has two slices"
        if sched.max_long_prefills is not None:
            longs = [s.seq_id for s in sched.running if s.num_tokens - s.num_cached > sched.long_prefill_threshold]
            assert len(longs) <= sched.max_long_prefills, f"step {step}: long prompts {longs} part-way through"
        total = sum(end - start for _, start, end, _, _ in self.rows)
        assert total <= self.budget, f"step {step}: {total} tokens over the budget {self.budget}"
        for p, (seq, start, end, decode, samples) in zip(plan, self.rows):
            assert seq.status is Status.RUNNING, f"step {step}: a slice of request {seq.seq_id}, {seq.status}"
            assert start == seq.num_cached and start < end <= seq.num_tokens, (
                f"step {step}: request {seq.seq_id} sliced {start}..{end}, "
                f"{seq.num_cached} of {seq.num_tokens} computed")
            assert p.token_ids(0, p.num_tokens) == seq.all_tokens()[:end], "a slice is the request cut at its end"
            assert p.prompt_ids is seq.prompt_ids and p.output_ids is seq.output_ids, "a slice copied the tokens"
            assert p.blocks is seq.blocks and len(seq.blocks) >= blocks_for(end, e.block_size), "blocks not reserved"
            assert decode == (seq in decodes), f"step {step}: request {seq.seq_id} decode flag {decode}"
            assert samples == (end == seq.num_tokens)
            if decode:
                assert end - start == 1
            elif self.cap is not None:
                assert end - start <= self.cap, f"step {step}: a prompt slice of {end - start} > {self.cap}"
                self.seen["capped"] += end - start == self.cap < seq.num_tokens - start
            if not decode and end - start == 1:
                self.seen["one_token_prompt"] += 1
            self.seen["unsampled"] += not samples
        fed = [s for s in decodes if s in seqs]
        left = [s for s in decodes if s not in seqs and s.status is Status.RUNNING]  # not a preemption victim
        if left:
            self.seen["left_out"] += 1
            assert all(d for *_, d, _ in self.rows) and total == self.budget, (
                f"step {step}: decodes {[s.seq_id for s in left]} left out, yet the plan is "
                f"{[(s.seq_id, a, b, d) for s, a, b, d, _ in self.rows]} ({total} of {self.budget} tokens)")
            key = lambda s: (self.last_fed.get(s.seq_id, -1), s.seq_id)  # noqa: E731
            for f in fed:
                for w in left:
                    assert key(f) < key(w), (
                        f"step {step}: decode {w.seq_id} (last fed at step {key(w)[0]}) waits while decode "
                        f"{f.seq_id} (last fed at step {key(f)[0]}) is fed: not the least recently fed first")
        if total < self.budget:  # the budget was not used up: nobody running was left out
            idle = [s.seq_id for s in sched.running if s not in seqs]
            assert not idle, f"step {step}: {total} of {self.budget} tokens used, yet running {idle} were not fed"
        self.seen["mixed"] += any(d for *_, d, _ in self.rows) and not all(d for *_, d, _ in self.rows)
        for seq in seqs:
            self.last_fed[seq.seq_id] = step

    def step(self) -> None:
        e, runner = self.engine, self.engine.runner
        outputs = {id(s): len(s.output_ids) for s in list(e.scheduler.running) + list(e.scheduler.waiting)}
        n_steps, fed = len(e.step_tokens), runner.tokens_fed
        self.rows = []
        e.step()
        total = sum(end - start for _, start, end, _, _ in self.rows)
        if self.rows:
            assert len(e.step_tokens) == n_steps + 1 and e.step_tokens[-1] == total == runner.tokens_fed - fed
        else:
            assert len(e.step_tokens) == n_steps and runner.tokens_fed == fed
        sliced = {id(seq): (end, samples) for seq, _, end, _, samples in self.rows}
        for seq, start, end, decode, samples in self.rows:
            grew = len(seq.output_ids) - outputs[id(seq)]
            assert grew == int(samples), (
                f"step {e.clock}: request {seq.seq_id} sliced {start}..{end} of {end if samples else '>' + str(end)}"
                f" tokens got {grew} new token(s)")
            assert seq.num_cached == end, f"request {seq.seq_id}: computed {seq.num_cached}, its slice ended at {end}"
            if samples:
                t = e.timing[seq.seq_id]
                assert t.token_steps[-1] == e.clock and len(t.token_steps) == len(seq.output_ids)
            if not decode:
                self.slices[seq.seq_id] = self.slices.get(seq.seq_id, 0) + 1
        for seq in list(e.scheduler.running) + list(e.scheduler.waiting):
            if id(seq) not in sliced and id(seq) in outputs:
                assert len(seq.output_ids) == outputs[id(seq)], f"request {seq.seq_id} sampled without a slice"
        assert e.prompt_slices == self.slices
        check_pool(e)

    def finish(self) -> None:
        self.seen["multi_slice"] += sum(n > 1 for n in self.slices.values())


def check_pool(engine) -> None:
    """L6's pool checks (tests/test_l6_scheduler.py), with L7's dummy block held once by no table."""
    sched, m, S = engine.scheduler, engine.allocator, engine.block_size
    holders = [0] * m.num_blocks
    holders[engine.dummy_block] = 1
    ids = [seq.seq_id for seq in sched.running]
    assert ids == sorted(ids), f"running is not in arrival order: {ids}"
    assert len(ids) <= sched.max_running, f"{len(ids)} running, max_running {sched.max_running} (siblings count)"
    for seq in sched.running:
        assert seq.status is Status.RUNNING
        assert seq.num_cached <= seq.num_tokens, f"request {seq.seq_id}: computed count past its token count"
        assert engine.dummy_block not in seq.blocks, f"request {seq.seq_id} was given the dummy block"
        assert len(set(seq.blocks)) == len(seq.blocks), "a table holds one block twice"
        for b in seq.blocks:
            holders[b] += 1
        tokens = seq.all_tokens()
        for p in range(seq.num_cached):  # its written history is intact: nothing it holds was reused
            assert pool_token(m.pool, seq.blocks[p // S], p % S) == tokens[p], f"request {seq.seq_id} lost position {p}"
    for seq in sched.waiting:
        assert seq.blocks == [] and seq.num_cached == 0 and seq.status is Status.WAITING
    assert holders == m.ref, "a reference count differs from the number of tables holding the block"
    free, lru, held = set(m._free), set(m._lru), {b for b in range(m.num_blocks) if m.ref[b]}
    assert len(free) + len(lru) + len(held) == m.num_blocks, "a block is in no state: leaked"


def drive(engine, workload: list[tuple[Arrival, int]]) -> tuple[list[list], Audit]:
    """Submit (arrival, n) pairs at their steps, step until done with every step audited; the n sequences
    of each arrival, in input order."""
    audit, seqs, k = Audit(engine), {}, 0
    order = sorted(range(len(workload)), key=lambda i: workload[i][0].step)
    for _ in range(5_000):
        while k < len(order) and workload[order[k]][0].step <= engine.clock:
            a, n = workload[order[k]]
            seqs[order[k]] = engine.add_parallel(a.prompt_ids, a.stop, a.sampling, n)
            k += 1
        if k == len(order) and not engine.scheduler.has_work():
            break
        audit.step()
    else:
        raise AssertionError("the engine did not finish: a hang")
    out = [seqs[i] for i in range(len(workload))]
    audit.finish()
    return out, audit


def workload(rng: random.Random, n: int, S: int, cap: int, span: int) -> list[tuple[Arrival, int]]:
    """Greedy requests, and now and then one with n = 2 or 3 seeded samples: forks are the only way a step
    can hold more decodes than the last one fed tokens, so the only way decodes outgrow the budget."""
    prefixes = [[rng.randrange(64) for _ in range(rng.randint(0, 3 * S))] for _ in range(3)]
    out: list[tuple[Arrival, int]] = []
    for _ in range(n):
        if out and rng.random() < 0.2:  # a duplicate prompt: a full prefix hit, or a wait for one in flight
            prompt = list(rng.choice(out)[0].prompt_ids)
        else:
            prompt = (rng.choice(prefixes) + [rng.randrange(64) for _ in range(rng.randint(0, 2 * S + 6))])
        prompt = prompt[: cap - 1] or [7]
        new = rng.randint(1, max(1, min(8, cap - len(prompt))))
        stop = StopRule(new, frozenset({rng.randrange(64)}), ignore_eos=rng.random() < 0.5)
        k = rng.choice([1, 1, 1, 1, 2, 3])
        sampling = SamplingParams(1.0, seed=rng.randrange(1000)) if k > 1 else SamplingParams()
        out.append((Arrival(prompt, stop, sampling, step=rng.randint(0, span)), k))
    return out


def long_limit(seed: int) -> dict:
    """Every third workload limits long prompts (its own generator: the others' workloads stay as they were)."""
    rng = random.Random(-1 - seed)
    if seed % 3:
        return {}
    return dict(max_long_prefills=rng.randint(1, 2), long_prefill_threshold=rng.randint(1, 12))


def run_one(seed: int) -> tuple[FakeL8, Audit]:
    rng = random.Random(seed)
    S = rng.randint(1, 8)
    num_blocks = rng.randint(3, 10)
    engine = fake_l8(S, num_blocks, max_running=rng.randint(1, 6), max_batched_tokens=rng.randint(1, 40),
                     max_slice_tokens=rng.choice([None, None, rng.randint(1, 12)]),
                     hash_fn=HASHES[rng.choice(["blake2b", "blake2b", "blake2b", "always 0"])],
                     wait_for_inflight=rng.random() < 0.7, **long_limit(seed))
    arrivals = workload(rng, rng.randint(2, 8), S, num_blocks * S, span=rng.randint(0, 10))
    seqs, audit = drive(engine, arrivals)
    for (a, n), group in zip(arrivals, seqs):
        for i, seq in enumerate(group):
            assert seq.status is Status.FINISHED and seq.blocks == []
            want = expected(a) if n == 1 else solo(a, a.sampling.seed + i)
            assert seq.output_ids == want, f"seed {seed}: request {seq.seq_id} (sample {i} of {n})"
            assert len(engine.timing[seq.seq_id].token_steps) == len(seq.output_ids)
    m = engine.allocator
    assert engine.usable_blocks == num_blocks and m.num_blocks == num_blocks + 1
    assert m.num_free == engine.usable_blocks, "a block is neither free nor cached at the end"
    assert m.ref[engine.dummy_block] == 1 and engine.runner.dummy_block == engine.dummy_block
    assert all(r == 0 for b, r in enumerate(m.ref) if b != engine.dummy_block), "a reference is still held"
    assert engine.dummy_block not in m.cache.entry, "the dummy block was cached"
    return engine, audit


@pytest.mark.parametrize("batch", range(20))
def test_random_chunked_workloads(batch):
    """12 workloads per case, 240 in all."""
    for seed in range(batch * 12, batch * 12 + 12):
        run_one(seed)


def test_the_random_workloads_exercise_what_they_check():
    totals = dict(preemptions=0, hits=0)
    for seed in range(60):
        engine, audit = run_one(seed)
        totals["preemptions"] += engine.stats.preemptions
        totals["hits"] += engine.stats.cached_tokens
        for k, v in audit.seen.items():
            totals[k] = totals.get(k, 0) + v
    assert all(totals.values()), totals


# --- bad budgets ---


class Counting(FakeChunkRunner):
    built = 0

    def __init__(self, *args, **kwargs):
        Counting.built += 1
        super().__init__(*args, **kwargs)


class CountingL8(L8Engine):
    runner_class = Counting


BAD = [0, -1, 2.5, 4.0, "8", True]


@pytest.mark.parametrize("option, value", [("max_batched_tokens", v) for v in BAD + [None]]
                         + [("max_slice_tokens", v) for v in BAD])  # None is max_slice_tokens' default: no cap
def test_a_bad_budget_is_one_line_before_anything_is_built(option, value):
    Counting.built = 0
    with pytest.raises(CourseError) as err:
        CountingL8(fake_model(), 4, 8, graphs=False, **{option: value})
    msg = str(err.value)
    assert "\n" not in msg and repr(value) in msg and option.replace("_", "-") in msg, msg
    assert Counting.built == 0, "the runner (and its pool) was built before the budget was checked"


@pytest.mark.task("L8.6")
def test_the_smallest_budget_runs():
    engine = fake_l8(2, 16, max_batched_tokens=1, max_slice_tokens=1)
    seqs, _ = drive(engine, [(Arrival([1, 2, 3], StopRule(3)), 1), (Arrival([4, 5], StopRule(2), step=1), 1)])
    assert [s.output_ids for s, in seqs] == [expected(Arrival([1, 2, 3], StopRule(3))),
                                           expected(Arrival([4, 5], StopRule(2)))]
    assert set(engine.step_tokens) == {1}


# --- exact schedules ---


def plans_of(engine) -> list[list[tuple]]:
    """Record every step's plan as (seq_id, first position fed, end, decode, samples)."""
    plans, schedule = [], engine.scheduler.schedule

    def recorded():
        plan = schedule()
        plans.append([(p.seq_id, p.num_cached, p.num_tokens, p.decode, p.samples) for p in plan])
        return plan

    engine.scheduler.schedule = recorded
    return plans


@pytest.mark.task("L8.6")
def test_the_worked_example_of_the_lesson():
    """docs/l8_chunked_prefill.md's trace (S = 4, budget 8; A 6 tokens and B 5 at clock 0, C 14 at clock 2),
    slice for slice and block for block: the schedule does not depend on the model."""
    engine = fake_l8(4, 32, max_batched_tokens=8)
    plans = plans_of(engine)
    a = engine.add_request(list(range(6)), StopRule(6))
    b = engine.add_request(list(range(10, 15)), StopRule(5))
    engine.step(), engine.step()
    c = engine.add_request(list(range(20, 34)), StopRule(3))
    tables = []
    while engine.scheduler.has_work():
        engine.step()
        tables.append([tuple(s.blocks) for s in (a, b, c)])
    A, B, C = a.seq_id, b.seq_id, c.seq_id
    assert plans == [
        [(A, 0, 6, False, True), (B, 0, 2, False, False)],
        [(A, 6, 7, True, True), (B, 2, 5, False, True)],
        [(A, 7, 8, True, True), (B, 5, 6, True, True), (C, 0, 6, False, False)],
        [(A, 8, 9, True, True), (B, 6, 7, True, True), (C, 6, 12, False, False)],
        [(A, 9, 10, True, True), (B, 7, 8, True, True), (C, 12, 14, False, True)],
        [(A, 10, 11, True, True), (B, 8, 9, True, True), (C, 14, 15, True, True)],
        [(C, 15, 16, True, True)],
    ]
    assert engine.step_tokens == [8, 4, 8, 8, 4, 3, 1]
    assert engine.dummy_block == 0
    assert tables[1][2] == (5, 6, 8) and tables[2][2] == (5, 6, 8, 9)  # C's blocks grow slice by slice
    assert engine.prompt_slices == {A: 1, B: 2, C: 3}
    assert [engine.timing[s].ttft_steps for s in (A, B, C)] == [1, 2, 3]
    for s, want in ((a, [1, 1, 1, 1, 1]), (b, [1, 1, 1, 1]), (c, [1, 1])):
        assert engine.timing[s.seq_id].gap_steps == want
    assert [s.output_ids for s in (a, b, c)] == [expected(Arrival(s.prompt_ids, s.stop)) for s in (a, b, c)]


def forked_decodes(n: int, budget: int, steps: int):
    """One sampled prompt of 3 tokens with n samples (its n - 1 siblings fork off it once its last slice
    runs, and sample their first token with it), then a second prompt submitted once they decode. Returns
    the engine, the plans and the second request."""
    engine = fake_l8(4, 64, max_running=n + 1, max_batched_tokens=budget)
    plans = plans_of(engine)
    parent = engine.add_parallel([1, 2, 3], StopRule(steps + 20), SamplingParams(1.0, seed=5), n=n)[0]
    while not parent.output_ids:
        engine.step()
    late = engine.add_request([9, 9, 9], StopRule(2))
    for _ in range(steps):
        engine.step()
    return engine, plans, late


@pytest.mark.task("L8.6")
@pytest.mark.parametrize("n, budget, first", [
    # Least recently fed first, ties to the older (lower id): the siblings, never fed, go before the parent
    # (fed by its prompt's last slice); decodes fed together keep that tie order afterwards.
    (5, 2, [[1, 2], [3, 4], [0, 1], [2, 3], [4, 0], [1, 2], [3, 0], [4, 1], [2, 0], [3, 1], [4, 0], [2, 1]]),
    (6, 2, [[1, 2], [3, 4], [5, 0], [1, 2], [3, 4], [0, 5], [1, 2], [3, 4], [0, 5]]),
])
def test_more_decodes_than_the_budget_take_turns(n, budget, first):
    """n decodes, budget 2: exactly 2 decodes a step, in the order above; no decode waits more than
    ceil(n / 2) steps (6 decodes: each exactly every 3rd step); and the waiting prompt never runs."""
    engine, plans, late = forked_decodes(n, budget, steps=4 * n)
    assert [len(p) for p in plans[:2]] == [1, 1] and plans[1][0][4], "the prompt: 2 tokens, then its last"
    decode_steps = plans[2:]
    for i, plan in enumerate(decode_steps):
        assert all(decode for *_, decode, _ in plan), f"step {i + 3}: a prompt slice while {n} decodes > budget"
        assert len(plan) == budget
    assert [[sid for sid, *_ in p] for p in decode_steps[:len(first)]] == first
    turn = -(-n // budget)  # a fair turn: every decode is fed at least once in any `turn` consecutive steps
    for i in range(len(decode_steps) - turn + 1):
        window = {sid for p in decode_steps[i:i + turn] for sid, *_ in p}
        assert window == set(range(n)), f"steps {i + 3}..{i + turn + 2}: {sorted(set(range(n)) - window)} not fed"
    fed = {sid: [i for i, p in enumerate(decode_steps) if any(r[0] == sid for r in p)] for sid in range(n)}
    gaps = {sid: {b - a for a, b in zip(steps, steps[1:])} for sid, steps in fed.items()}
    if n % budget == 0:  # 6 decodes, 2 a step: each exactly every 3rd step
        assert all(g == {n // budget} for g in gaps.values()), gaps
    else:  # 5 decodes, 2 a step: gaps of 2 and 3
        assert all(g <= {n // budget, turn} for g in gaps.values()), gaps
    assert late.num_cached == 0 and late.status is Status.WAITING, "a prompt ran while decodes exceed the budget"
    assert set(engine.step_tokens[2:]) == {budget}


@pytest.mark.task("L8.6")
def test_a_prompt_waits_for_the_decodes_then_gets_what_they_leave():
    engine, plans, late = forked_decodes(3, 4, steps=3)
    # 3 decodes, budget 4: every step feeds all 3 and gives the 4th token to the waiting prompt.
    assert plans[0] == [(0, 0, 3, False, True)]  # the whole prompt in step 1: the siblings fork off it
    L = late.seq_id
    assert [[(sid, d, smp) for sid, _, _, d, smp in p] for p in plans[1:]] == [
        [(1, True, True), (2, True, True), (0, True, True), (L, False, False)],  # never-fed siblings first
        [(0, True, True), (1, True, True), (2, True, True), (L, False, False)],  # ties: the older first
        [(0, True, True), (1, True, True), (2, True, True), (L, False, True)],
    ]
    assert late.output_ids and engine.prompt_slices[late.seq_id] == 3


@pytest.mark.task("L8.6")
def test_a_preempted_decodes_token_goes_back_to_the_step():
    """S = 1, 7 blocks, budget 2, one prompt sampled 3 times. In step 4 the sibling fed longest ago (2) is
    planned first; then the parent cannot grow and evicts the youngest running request, that very sibling:
    its token returns to the budget, so the parent and sibling 1 both decode (without the refund sibling 1
    would wait with a token of the budget unused, which the audit refuses)."""
    engine = fake_l8(1, 7, max_running=3, max_batched_tokens=2)
    plans = plans_of(engine)
    a = Arrival([1, 2], StopRule(6), SamplingParams(1.0, seed=3))
    (group,), _ = drive(engine, [(a, 3)])
    assert plans[1] == [(1, 2, 3, True, True), (2, 2, 3, True, True)]
    assert plans[2] == [(0, 2, 3, True, True), (1, 3, 4, True, True)]
    assert plans[3] == [(0, 3, 4, True, True), (1, 4, 5, True, True)]  # 2 was planned, then evicted
    assert group[2].extra["fed_at"] > 4 and engine.stats.preemptions >= 1
    assert [s.output_ids for s in group] == [solo(a, 3 + i) for i in range(3)]


@pytest.mark.task("L8.6")
def test_a_request_preempted_mid_prompt_is_readmitted_with_a_token_to_compute():
    """S = 2, budget 2. B (a 2-block prefix of A's tokens) is admitted with A's first block as a hit and a
    1-token slice; A's next decode preempts it. Readmitted, A's blocks cover B's whole prompt, yet at least
    one token must be fed (its logits give the first token): at most (4 - 1) // 2 = 1 block is a hit."""
    engine = fake_l8(2, 4, max_batched_tokens=2)
    arrivals = [(Arrival([1, 2, 3, 4, 5], StopRule(4)), 1), (Arrival([1, 2, 3, 4], StopRule(2), step=3), 1)]
    ((a,), (b,)), _ = drive(engine, arrivals)
    assert engine.stats.preemptions == 1
    assert b.output_ids == expected(arrivals[1][0]) and a.output_ids == expected(arrivals[0][0])


# --- sampling does not depend on how a prompt is sliced ---


def sampled_workload() -> list[tuple[Arrival, int]]:
    rng = random.Random(7)
    out = []
    for i in range(6):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 23))]
        sampling = SamplingParams(rng.choice([0.7, 1.0, 1.5]), top_k=rng.choice([0, 8]), top_p=rng.choice([1.0, 0.9]),
                                  seed=rng.randrange(1000))
        out.append((Arrival(prompt, StopRule(rng.randint(3, 9)), sampling, step=rng.randint(0, 4)), 1 + (i % 3 == 0)))
    out.append((Arrival([3, 1, 4, 1, 5], StopRule(6)), 1))  # and a greedy one
    return out


def run_sampled(engine, arrivals: list[tuple[Arrival, int]]) -> list[list[list[int]]]:
    groups, k = {}, 0
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0].step)
    while k < len(order) or engine.scheduler.has_work():
        while k < len(order) and arrivals[order[k]][0].step <= engine.clock:
            a, n = arrivals[order[k]]
            groups[order[k]] = engine.add_parallel(a.prompt_ids, a.stop, a.sampling, n)
            k += 1
        engine.step()
    return [[s.output_ids for s in groups[i]] for i in range(len(arrivals))]


def test_seeded_sampling_is_the_same_for_any_budget():
    """A slice that stops inside a prompt gets no logits row and draws no random number, so each seeded
    request samples the same tokens in 4-token steps, in whole-prompt steps, and on L6 (no slices)."""
    arrivals = sampled_workload()
    S = 4
    runs = {}
    for name, kwargs in {"budget 4": dict(max_batched_tokens=4), "budget 4096": dict(max_batched_tokens=4096),
                         "budget 7, slices of 1": dict(max_batched_tokens=7, max_slice_tokens=1)}.items():
        engine = fake_l8(S, 64, **kwargs)
        runs[name] = run_sampled(engine, arrivals)
        if name != "budget 4096":
            assert max(engine.prompt_slices.values()) > 3, "the prompts were not sliced"
    l6 = L6Engine(fake_model(), S, 64, runner=FakeRunner(S, 64))
    runs["L6"] = run_sampled(l6, arrivals)
    first = runs["budget 4096"]
    assert all(run == first for run in runs.values()), {k: v == first for k, v in runs.items()}
    assert first[-1] == [expected(arrivals[-1][0])]
    assert len({tuple(t) for group in first for t in group}) > 5  # the seeds really sampled different tokens

"""L8's build-track tests (scripts/course.py check L8): the slice, admission under a budget, reserving with
preemption, the step's plan and the runner's scored rows, each on its own; the scheduler's rounds go through
the model-free fake runner, step by step, without the engine. The engine's tests are marked in
test_l8_scheduler.py and test_l8_parity.py."""
import pytest
import torch

from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l3_block_tensor.runner import PagedRunner
from lessons.l4_continuous.sequence import Sequence, Status
from lessons.l6_prefix_sharing.prefix_cache import chain_keys
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l8_chunked_prefill.runner import ChunkedRunner
from lessons.l8_chunked_prefill.slice import Slice
from shared.errors import CourseError
from shared.generation import StopRule
from test_l8_scheduler import fake_l8

S = 4
CPU = torch.device("cpu")


def rows(plan: list[Slice]) -> list[tuple]:
    """(seq_id, first position fed, end, decode, samples) per slice."""
    return [(p.seq_id, p.num_cached, p.num_tokens, p.decode, p.samples) for p in plan]


def ran(plan: list[Slice]) -> None:
    """What the forward and the engine do with a plan, without them: each request has computed up to its
    slice's end, and a slice that reached the end samples a token (always 7 here)."""
    for piece in plan:
        piece.seq.num_cached = piece.num_tokens
        if piece.samples:
            piece.seq.output_ids.append(7)


def start_step(sched, budget: int) -> None:
    """What schedule() does before it plans (for the tasks that come before it)."""
    sched.step_no += 1
    sched.budget, sched.plan = budget, []


# --- task 1: the slice ---


@pytest.mark.task("L8.1")
def test_a_slice_is_the_request_cut_short():
    seq = SharedSequence(list(range(10, 20)), S, seq_id=3, blocks=[5, 6, 7], num_cached=4)
    s = Slice.of(seq, 3)
    assert (s.num_cached, s.num_tokens) == (4, 7), \
        f"Slice.of(seq, 3) with 4 computed feeds positions 4..6: num_cached 4, num_tokens 7; got {s.num_cached}, {s.num_tokens}"
    assert s.seq is seq and s.seq_id == 3 and not s.decode
    assert s.prompt_ids is seq.prompt_ids and s.output_ids is seq.output_ids and s.blocks is seq.blocks, \
        "a slice holds the request's own token lists and block table, never copies"
    assert s.token_ids(s.num_cached, s.num_tokens) == [14, 15, 16]
    assert not s.samples, "a slice that stops inside the prompt (7 of 10) samples nothing"
    assert Slice.of(seq, 6).samples, "a slice that reaches the request's last token (10 of 10) samples"
    meta = BatchMeta.build([s], S, CPU)
    assert meta.positions.tolist() == [4, 5, 6] and meta.kv_indices.tolist() == [5, 6], \
        "L3's metadata sees a request of 7 tokens: 2 pages, block 7 (reserved past the end) is not named"
    for bad in (0, 7):
        with pytest.raises(ValueError):
            Slice.of(seq, bad)  # 1 .. 6 tokens are left to compute
    seq.num_cached, seq.output_ids[:] = 10, [42]
    d = Slice.of(seq, 1, decode=True)
    assert d.decode and d.samples and d.token_ids(10, 11) == [42], "a decode slice feeds the sampled token"


# --- task 2: admission under the budget ---


def cached_prefix(engine, tokens: list[int], n: int) -> list[int]:
    """n full blocks of `tokens` in the prefix cache, held by nobody (what an earlier request leaves)."""
    m, cache = engine.allocator, engine.cache
    blocks = m.alloc(n)
    for i, (b, key) in enumerate(zip(blocks, chain_keys(tokens, [], S, n, cache.hash_fn))):
        parent = cache.ident(blocks[i - 1]) if i else None
        cache.register(b, key, parent, tuple(tokens[i * S:(i + 1) * S]))
    m.free(blocks)
    return blocks


@pytest.mark.task("L8.2")
def test_admission_takes_a_first_slice_of_what_the_budget_leaves():
    engine = fake_l8(S, 16, max_batched_tokens=8)
    sched = engine.scheduler
    a = engine.add_request(list(range(10)), StopRule(2))
    b = engine.add_request(list(range(20, 25)), StopRule(2))
    start_step(sched, 8)
    sched.admit()
    assert rows(sched.plan) == [(a.seq_id, 0, 8, False, False)], \
        f"plan {rows(sched.plan)}: a 10-token prompt under a budget of 8 gets a first slice of 8 tokens"
    assert len(a.blocks) == 2, f"only the slice's blocks are reserved (8 tokens: 2), not the prompt's 3; got {len(a.blocks)}"
    assert sched.budget == 0 and a.extra["fed_at"] == sched.step_no, "take() charges the budget and stamps fed_at"
    assert list(sched.waiting) == [b] and sched.running == [a], "no budget left: the second request waits"
    st = engine.stats
    assert (st.prompt_tokens, st.cached_tokens, st.prefill_tokens) == (10, 0, 10)


@pytest.mark.task("L8.2")
def test_a_cache_hit_shortens_the_first_slice():
    engine = fake_l8(S, 16, max_batched_tokens=8, max_slice_tokens=3)
    sched = engine.scheduler
    prompt = list(range(30, 41))  # 11 tokens
    hit = cached_prefix(engine, prompt, 2)
    a = engine.add_request(prompt, StopRule(2))
    start_step(sched, 8)
    sched.admit()
    assert a.blocks[:2] == hit and a.num_cached == 8, f"the 2 cached blocks are hits: blocks {a.blocks}, {a.num_cached} cached"
    assert rows(sched.plan) == [(a.seq_id, 8, 11, False, True)], \
        f"plan {rows(sched.plan)}: after the hit 3 tokens are left, and the slice (cap 3) takes them all and samples"
    assert sched.budget == 5
    sched.budget = 2
    assert sched.slice_size(10) == 2, "slice_size: what is left, at most the budget left"
    sched.budget = 8
    assert sched.slice_size(10) == 3 and sched.slice_size(1) == 1, "and at most max_slice_tokens (3)"


# --- task 3: blocks for a slice's end, preempting the youngest ---


def two_admitted(num_blocks: int, budget: int = 16):
    """Two 8-token prompts admitted in one step, each with a whole-prompt slice: 4 blocks in use."""
    engine = fake_l8(S, num_blocks, max_batched_tokens=budget)
    sched = engine.scheduler
    a = engine.add_request(list(range(8)), StopRule(4))
    b = engine.add_request(list(range(10, 18)), StopRule(4))
    start_step(sched, budget)
    sched.admit()
    assert len(sched.plan) == 2
    return engine, sched, a, b


@pytest.mark.task("L8.3")
def test_reserving_preempts_the_youngest_and_refunds_its_slice():
    engine, sched, a, b = two_admitted(4)  # the pool is full
    assert sched.reserve(a, 9), "a (the oldest) gets its block by preempting b"
    assert len(a.blocks) == 3 and b.blocks == [] and b.status is Status.WAITING and b.num_cached == 0, \
        f"b (the youngest) is preempted: blocks {b.blocks}, {b.status}"
    assert rows(sched.plan) == [(a.seq_id, 0, 8, False, True)], f"b's slice leaves the plan: {rows(sched.plan)}"
    assert sched.budget == 8, f"b's 8 tokens go back to the step's budget: budget {sched.budget}"
    assert engine.stats.preemptions == 1 and sched.running == [a]


@pytest.mark.task("L8.3")
def test_the_youngest_yields_and_one_alone_with_the_pool_is_an_error():
    engine, sched, a, b = two_admitted(4)
    assert not sched.reserve(b, 9), "b is the youngest: it is its own victim, and reserve says it yielded (False)"
    assert sched.running == [a] and b.status is Status.WAITING and sched.budget == 8
    assert len(a.blocks) == 2 and engine.stats.preemptions == 1
    with pytest.raises(CourseError, match="pool has"):
        sched.reserve(a, 17)  # alone, and 17 tokens need 5 blocks of the 4: waiting cannot help
    assert sched.reserve(a, 12) and len(a.blocks) == 3, "room without preempting anybody: just the blocks"


# --- task 4: the plan ---


@pytest.mark.task("L8.4")
def test_the_plan_decodes_first_then_prompt_slices_then_admissions():
    """The lesson's worked example, S = 4, budget 8: A (6 tokens) and B (5) at the start, C (14) after step 2."""
    engine = fake_l8(S, 32, max_batched_tokens=8)
    sched = engine.scheduler
    a = engine.add_request(list(range(6)), StopRule(6))
    b = engine.add_request(list(range(10, 15)), StopRule(5))
    A, B = a.seq_id, b.seq_id
    want = [
        [(A, 0, 6, False, True), (B, 0, 2, False, False)],  # A whole, B gets the 2 tokens left
        [(A, 6, 7, True, True), (B, 2, 5, False, True)],  # A decodes first; B's rest of the prompt
    ]
    for i, expected in enumerate(want):
        plan = sched.schedule()
        assert rows(plan) == expected, f"step {i + 1}: plan {rows(plan)}, want {expected}"
        ran(plan)
    c = engine.add_request(list(range(20, 34)), StopRule(3))
    C = c.seq_id
    for i, expected in enumerate([
        [(A, 7, 8, True, True), (B, 5, 6, True, True), (C, 0, 6, False, False)],  # 2 decodes, C's first 6
        [(A, 8, 9, True, True), (B, 6, 7, True, True), (C, 6, 12, False, False)],
        [(A, 9, 10, True, True), (B, 7, 8, True, True), (C, 12, 14, False, True)],
    ]):
        plan = sched.schedule()
        assert rows(plan) == expected, f"step {i + 3}: plan {rows(plan)}, want {expected}"
        ran(plan)
    assert c.blocks and len(c.blocks) == 4, "C's blocks grew slice by slice to 4"


@pytest.mark.task("L8.4")
def test_more_decodes_than_the_budget_take_turns_least_recently_fed_first():
    engine = fake_l8(S, 32, max_batched_tokens=8)
    sched = engine.scheduler
    seqs = [engine.add_request([40 + i, 5], StopRule(30)) for i in range(3)]
    ran(sched.schedule())  # the three prompts, 2 tokens each
    sched.max_batched_tokens = 2  # now 3 decodes, 2 tokens a step
    last = {s.seq_id: 1 for s in seqs}
    for step in range(2, 9):
        plan = sched.schedule()
        fed = [p.seq_id for p in plan]
        want = sorted(last, key=lambda i: (last[i], i))[:2]  # fed longest ago first; ties: the older (lower id)
        assert fed == want and all(p.decode for p in plan), \
            f"step {step}: fed {fed}, want {want} (last fed at {last}): the least recently fed decodes first"
        for i in fed:
            last[i] = step
        ran(plan)


# --- task 5: the runner ---


@pytest.mark.task("L8.5")
def test_the_forward_scores_only_the_slices_that_sample(tiny_model, prompt_ids, monkeypatch):
    """Step 1: A's first 6 of 10 tokens and B's whole 5-token prompt; step 2: B's decode and A's last 4.
    Each sampling row equals what L3's eager forward gives that request alone; A's first slice has no row."""
    runner, alone = ChunkedRunner(tiny_model, S, 16, "torch"), ChunkedRunner(tiny_model, S, 16, "torch")
    a, b = Sequence(list(prompt_ids[3][:10]), S, seq_id=0), Sequence(list(prompt_ids[0]), S, seq_id=1)
    a_alone, b_alone = Sequence(list(a.prompt_ids), S), Sequence(list(b.prompt_ids), S)
    for r, pool in ((a, runner), (b, runner), (a_alone, alone), (b_alone, alone)):
        r.reserve(11, pool.allocator)
    projected = []
    logits_of = tiny_model.logits
    monkeypatch.setattr(tiny_model, "logits", lambda hidden: projected.append(len(hidden)) or logits_of(hidden))
    first = [Slice.of(a, 6), Slice.of(b, 5)]
    got = runner.forward(first)
    assert projected == [1] and tuple(got.shape) == (1, tiny_model.config.vocab_size), \
        f"step 1: only B's slice samples: 1 row projected onto the vocabulary (got {projected}), logits [1, vocab]"
    assert [s.num_cached for s in first] == [6, 5], "the forward sets each slice's num_cached to its end"
    # Logits up to about 50 in magnitude, summed in another order in another batch: measured 5.7e-5 here and 7.4e-5 in
    # step 2 (Intel Xeon AMX), 0 and 3.8e-5 (torch capped to AVX2), 1.3x under the 1e-4 this had; 5e-4 is a 6.7x
    # margin, and a slice scored over another request's rows or positions moves logits by far more.
    torch.testing.assert_close(got[0], PagedRunner.forward(alone, [b_alone])[0], rtol=0, atol=5e-4)
    a.num_cached, b.num_cached = 6, 5
    b.output_ids.append(int(got[0].argmax()))
    b_alone.output_ids.append(b.output_ids[-1])
    projected.clear()
    got = runner.forward([Slice.of(b, 1, decode=True), Slice.of(a, 4)])
    assert projected == [2], f"step 2: both slices sample: 2 rows projected (got {projected})"
    want = [PagedRunner.forward(alone, [b_alone])[0], PagedRunner.forward(alone, [a_alone])[0]]
    for i, name in enumerate(["B's decode", "A's last slice"]):
        torch.testing.assert_close(got[i], want[i], rtol=0, atol=5e-4,
                                   msg=lambda m, name=name: f"{name}: logits differ from the request alone: {m}")


@pytest.mark.task("L8.5")
def test_only_a_step_of_decodes_replays_a_graph(tiny_model):
    runner = ChunkedRunner(tiny_model, S, 16, "torch")
    runner.sizes = [1, 2, 4]  # as if captured

    def decode(i: int) -> Slice:
        return Slice.of(Sequence([1, 2, 3], S, output_ids=[4], num_cached=3, seq_id=i), 1, decode=True)

    one_token_prompt = Slice.of(Sequence([1, 2], S, num_cached=1, seq_id=9), 1)  # samples, but not a decode
    assert runner.graph_size([decode(0), decode(1), decode(2)]) == 4, "3 decodes replay size 4"
    assert runner.graph_size([decode(0), one_token_prompt]) is None, \
        "a step holding a prompt slice runs eagerly, even when every row is one token wide"
    assert runner.graph_size([decode(i) for i in range(5)]) is None, "5 decodes: above the largest size, eager"

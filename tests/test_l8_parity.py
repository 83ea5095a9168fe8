"""L8 (chunked prefill) on the real tiny model: whatever the token budget, the slice cap, the block size,
preemption, prefix hits or graphs, every request's greedy tokens equal HF's for its prompt alone, and a
seeded sampled request draws the same tokens whatever the budget. The reference is computed by HF in the
same run (the `hf` fixture); nothing here is a stored token list."""
from __future__ import annotations

import math

import pytest

from lessons.l4_continuous.engine import Arrival
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from lessons.l8_chunked_prefill import L8Engine
from shared.generation import StopRule

NEW = 8
BIG = 128  # a budget larger than every prompt used here (the longest is 101 tokens)


def stop_for(model, new: int = NEW) -> StopRule:
    return StopRule(new, frozenset(model.config.eos_token_ids), ignore_eos=True)


def engine_for(model, block_size: int, budget: int, num_blocks: int | None = None, **kwargs) -> L8Engine:
    return L8Engine(model, block_size, num_blocks, backend="torch", max_batched_tokens=budget, **kwargs)


def assert_no_leak(engine: L8Engine) -> None:
    """Every block is free or cached once all requests are done; only the dummy block is still held."""
    assert engine.allocator.num_free == engine.usable_blocks
    held = [b for b, r in enumerate(engine.allocator.ref) if r]
    assert held == [engine.dummy_block] and engine.allocator.ref[engine.dummy_block] == 1


def drain(engine: L8Engine) -> None:
    while engine.scheduler.has_work():
        engine.step()


# --- 1. the budget x block-size matrix -------------------------------------------------------------------


def budget_cases() -> list:
    cases = []
    for block_size in (1, 4, 16):
        budgets = []
        for b in (1, 3, block_size - 1, block_size, block_size + 1, 64, BIG):
            if b >= 1 and b not in budgets:  # block size 1: B - 1 is 0 (skipped), B is budget 1 again
                budgets.append(b)
        cases += [pytest.param(block_size, b, id=f"B{block_size}-budget{b}") for b in budgets]
    return cases


@pytest.mark.parametrize("block_size,budget", budget_cases())
def test_any_budget_and_block_size_keeps_parity(tiny_model, hf, prompt_ids, block_size, budget):
    """A long prompt (101 tokens: 7+ blocks of 16), three short ones and two repeats, one arrival a step: the
    repeats hit the cache, no step computes more than the budget, and every prompt token and every decode is
    computed exactly once (no preemption with the default pool)."""
    stop = stop_for(tiny_model)
    long, short = prompt_ids[3], prompt_ids[:3]
    prompts = [long, short[0], short[1], long, short[2], short[0]]
    assert BIG > max(len(p) for p in prompts)
    engine = engine_for(tiny_model, block_size, budget)
    got = engine.generate_batch(prompts, stop, stagger=1)
    assert got == [hf.generate(p, stop).tokens for p in prompts]
    s = engine.stats
    assert s.cached_tokens > 0, "the repeated long prompt must hit the prefix cache"
    assert s.preemptions == 0
    assert max(engine.step_tokens) <= budget
    assert sum(engine.step_tokens) == s.prefill_tokens + sum(len(o) - 1 for o in got)
    # The first request is alone until its prompt is done (nobody decodes yet): it takes whole budgets.
    assert engine.prompt_slices[0] == math.ceil(len(long) / budget)
    if budget == BIG:
        assert all(n == 1 for n in engine.prompt_slices.values()), "a budget above every prompt never chunks"
    assert_no_leak(engine)


# --- 2. prompts around the slice size ----------------------------------------------------------------------

SLICE = 6  # with blocks of 4: slices end inside a block, and the next slice continues that block


@pytest.mark.parametrize("length", [SLICE - 1, SLICE, SLICE + 1, 3 * SLICE + 1],
                         ids=["shorter", "equal", "one-longer", "three-and-one"])
@pytest.mark.parametrize("cap", ["budget", "max-slice"])
def test_slices_of_a_prompt_alone(tiny_model, hf, prompt_ids, cap, length):
    """Alone (no decode competes), a prompt of L tokens takes ceil(L / slice) steps of `slice` tokens, the
    last one the remainder; then one token a step. The slice is the budget, or max_slice_tokens under a
    large budget."""
    stop = stop_for(tiny_model)
    prompt = prompt_ids[3][:length]
    kw = {"budget": SLICE} if cap == "budget" else {"budget": 64, "max_slice_tokens": SLICE}
    engine = engine_for(tiny_model, 4, **kw)
    seq = engine.add_request(prompt, stop)
    drain(engine)
    assert seq.output_ids == hf.generate(prompt, stop).tokens
    full, rest = divmod(length, SLICE)
    assert engine.prompt_slices == {seq.seq_id: math.ceil(length / SLICE)}
    assert engine.step_tokens == [SLICE] * full + [rest] * (rest > 0) + [1] * (NEW - 1)
    assert_no_leak(engine)


@pytest.mark.task("L8.6")
def test_max_slice_tokens_caps_each_request_not_the_step(tiny_model, hf, prompt_ids):
    """Two prompts arriving together under a large budget: each gets its own slice of max_slice_tokens in
    the same step (the step computes two slices), so both take ceil(L / slice) slices."""
    stop = stop_for(tiny_model)
    prompts = [prompt_ids[3][:13], prompt_ids[3][50:63]]  # different first blocks: no prefix hits
    engine = engine_for(tiny_model, 4, 64, max_slice_tokens=SLICE)
    seqs = [engine.add_request(p, stop) for p in prompts]
    drain(engine)
    assert [s.output_ids for s in seqs] == [hf.generate(p, stop).tokens for p in prompts]
    assert engine.prompt_slices == {s.seq_id: 3 for s in seqs}
    assert engine.step_tokens[:3] == [2 * SLICE, 2 * SLICE, 2]
    assert engine.stats.cached_tokens == 0
    assert_no_leak(engine)


# --- 3. preemption of a partly prefilled request -----------------------------------------------------------


@pytest.mark.parametrize("num_blocks,budget,long_len", [(6, 3, 16), (8, 3, 24), (8, 6, 24)],
                         ids=["6blocks-budget3-L16", "8blocks-budget3-L24", "8blocks-budget6-L24"])
def test_preempting_a_request_mid_prompt_keeps_parity(tiny_model, hf, prompt_ids, num_blocks, budget, long_len):
    """A small pool: a request still part-way through its prompt is preempted (its computed tokens dropped);
    re-admitted, it hits the blocks its earlier slices filled. The three prompts start with different
    blocks, so every cache hit here is a request re-hitting its own blocks."""
    S = 4
    prompts = [prompt_ids[0], prompt_ids[3][:long_len], prompt_ids[1]]
    stops = [stop_for(tiny_model, 12), stop_for(tiny_model), stop_for(tiny_model)]
    engine = engine_for(tiny_model, S, budget, num_blocks)
    seqs, mid_prompt, step = [], [], 0
    while step < len(prompts) or engine.scheduler.has_work():
        if step < len(prompts):
            seqs.append(engine.add_request(prompts[step], stops[step]))
        before = {s.seq_id: s.num_cached for s in engine.scheduler.running}
        preemptions = engine.stats.preemptions
        engine.step()
        step += 1
        if engine.stats.preemptions > preemptions:
            for s in seqs:
                if s.seq_id in before and s.status is Status.WAITING and 0 < before[s.seq_id] < len(s.prompt_ids):
                    mid_prompt.append((s.seq_id, before[s.seq_id], engine.stats.cached_tokens))
    assert [s.output_ids for s in seqs] == [hf.generate(p, st).tokens for p, st in zip(prompts, stops)]
    assert engine.stats.preemptions > 0
    assert mid_prompt, "no request was preempted part-way through its prompt"
    victim, computed, hits_then = mid_prompt[0]
    assert computed >= S, "the victim had filled at least one block"
    assert engine.stats.cached_tokens > hits_then, "re-admission did not re-hit the victim's own blocks"
    assert max(engine.step_tokens) <= budget
    assert_no_leak(engine)


def test_an_older_prompt_slice_evicts_a_decode_already_in_the_step(tiny_model, hf, prompt_ids):
    """max_slice_tokens lets a short request start decoding while an older long prompt is still being
    sliced. The decode is scheduled first; then the older prompt's slice needs a block, the pool is dry and
    the decode (the youngest) is evicted: its row must leave the step it was already planned into."""
    prompts = [prompt_ids[3][:24], prompt_ids[0], prompt_ids[1]]
    stops = [stop_for(tiny_model), stop_for(tiny_model, 12), stop_for(tiny_model, 12)]
    engine = engine_for(tiny_model, 4, 8, 8, max_slice_tokens=4)
    seqs, evicted_decodes, step = [], [], 0
    while step < len(prompts) or engine.scheduler.has_work():
        if step < len(prompts):
            seqs.append(engine.add_request(prompts[step], stops[step]))
        before = {s.seq_id: (s.num_tokens - s.num_cached, bool(s.output_ids)) for s in engine.scheduler.running}
        prompting = [s.seq_id for s in engine.scheduler.running if s.num_cached < len(s.prompt_ids)]
        engine.step()
        step += 1
        for s in seqs:
            if s.seq_id in before and s.status is Status.WAITING and before[s.seq_id] == (1, True):
                if any(older < s.seq_id for older in prompting):
                    evicted_decodes.append(s.seq_id)
    assert [s.output_ids for s in seqs] == [hf.generate(p, st).tokens for p, st in zip(prompts, stops)]
    assert evicted_decodes, "no decode was evicted by an older request still in its prompt"
    assert max(engine.step_tokens) <= 8
    assert_no_leak(engine)


# --- 4. one prompt computed once when two arrive together ---------------------------------------------------


@pytest.fixture(scope="module")
def alone_step_tokens(tiny_model, hf):
    """The tokens each step computes for the prompt alone, per (block_size, budget, length), checked against HF
    once: the wait and no-wait cases below compare with the same lone run, so it runs once for both."""
    memo: dict[tuple, list[int]] = {}

    def run(block_size: int, budget: int, prompt: list[int]) -> list[int]:
        key = (block_size, budget, tuple(prompt))
        if key not in memo:
            stop = stop_for(tiny_model)
            alone = engine_for(tiny_model, block_size, budget)
            assert alone.generate_batch([prompt], stop) == [hf.generate(prompt, stop).tokens]
            memo[key] = list(alone.step_tokens)
        return memo[key]

    return run


@pytest.mark.parametrize("wait", [True, False], ids=["wait", "no-wait"])
@pytest.mark.parametrize("block_size,budget,length", [(4, 16, 101), (4, 5, 30), (16, 24, 101), (16, 40, 96)],
                         ids=["B4-budget16-L101", "B4-budget5-L30", "B16-budget24-L101", "B16-budget40-L96"])
def test_two_identical_prompts_in_one_step_compute_it_once(tiny_model, hf, prompt_ids, alone_step_tokens, block_size,
                                                           budget, length, wait):
    """wait_for_inflight (the default): the second waits while the first's slices fill the blocks it would
    hit, then hits all but the last token's block, so it computes at most one block's worth. Without it, the
    second is admitted with the budget the first's last slice leaves, hits the blocks written so far and
    computes at most those being written in that step plus one block."""
    stop = stop_for(tiny_model)
    prompt = prompt_ids[3][:length]
    assert budget < length
    alone = alone_step_tokens(block_size, budget, prompt)
    engine = engine_for(tiny_model, block_size, budget, wait_for_inflight=wait)
    got = engine.generate_batch([prompt, prompt], stop, stagger=0)
    assert got == [hf.generate(prompt, stop).tokens] * 2
    second = engine.stats.prefill_tokens - length
    if wait:
        hit = block_size * ((length - 1) // block_size)  # a full match still leaves one token to compute
        assert engine.stats.cached_tokens == hit and second == length - hit
        assert 1 <= second <= block_size
    else:
        assert engine.stats.cached_tokens > 0 and 1 <= second <= block_size + budget
    # Counted from the steps themselves: the pair costs one run plus the second's tail and its decodes.
    assert sum(engine.step_tokens) - sum(alone) == second + NEW - 1
    assert max(engine.step_tokens) <= budget
    assert_no_leak(engine)


# --- 5. a fully cached, block-aligned prompt ----------------------------------------------------------------


@pytest.mark.parametrize("block_size,first,second,budget", [
    pytest.param(4, 20, 16, 1, id="B4-L16-after-L20-budget1"),
    pytest.param(4, 20, 16, 3, id="B4-L16-after-L20-budget3"),
    pytest.param(4, 16, 16, 64, id="B4-L16-twice-budget64"),
    pytest.param(1, 12, 12, 1, id="B1-L12-twice-budget1"),
    pytest.param(16, 40, 32, 5, id="B16-L32-after-L40-budget5"),
])
def test_a_fully_cached_aligned_prompt_still_computes_its_last_token(tiny_model, hf, prompt_ids, block_size,
                                                                      first, second, budget):
    """Every block of the second prompt is cached and it ends on a block boundary: the hit stops one block
    short, so its slices compute that block (a non-empty query) and its first token equals HF's."""
    stop = stop_for(tiny_model)
    prompts = [prompt_ids[3][:first], prompt_ids[3][:second]]
    assert second % block_size == 0
    engine = engine_for(tiny_model, block_size, budget)
    got = engine.run([Arrival(prompts[0], stop, step=0), Arrival(prompts[1], stop, step=1000)])  # one alone
    assert got == [hf.generate(p, stop).tokens for p in prompts]
    hit = second - block_size
    assert engine.stats.cached_tokens == hit
    assert engine.stats.prefill_tokens == first + block_size
    assert engine.prompt_slices[1] == math.ceil(block_size / budget)
    tail = [budget] * (block_size // budget) + [block_size % budget] * (block_size % budget > 0)
    assert engine.step_tokens[-(len(tail) + NEW - 1):] == tail + [1] * (NEW - 1)
    assert_no_leak(engine)


# --- 6. seeded sampling does not depend on the budget ---------------------------------------------------------

SEED = 11


def sampled_run(model, budget: int, max_slice: int | None, prompt_ids) -> tuple[dict, L8Engine]:
    """Arrivals over three steps: a long prompt forked 3 ways, a short sampled one, a greedy one, and the
    long prompt alone with child 1's seed (it must sample what child 1 samples)."""
    stop = stop_for(model)
    sampling = SamplingParams(temperature=0.8, top_k=50, seed=SEED)
    long = prompt_ids[3][:40]
    engine = engine_for(model, 4, budget, max_slice_tokens=max_slice)
    out: dict[str, list] = {}
    step = 0
    while step < 3 or engine.scheduler.has_work():
        if step == 0:
            out["fork"] = engine.add_parallel(long, stop, sampling, n=3)
        elif step == 1:
            out["short"] = [engine.add_request(prompt_ids[0], stop, SamplingParams(0.8, top_k=50, seed=SEED + 7))]
            out["greedy"] = [engine.add_request(prompt_ids[1], stop)]
        elif step == 2:
            out["child1-alone"] = [engine.add_request(long, stop, SamplingParams(0.8, top_k=50, seed=SEED + 1))]
        engine.step()
        step += 1
    return out, engine


@pytest.mark.parametrize("budget,max_slice", [(4096, 3), (4, None), (4, 3)],
                         ids=["budget4096-slice3", "budget4", "budget4-slice3"])
def test_seeded_sampling_is_the_same_for_any_budget(tiny_model, hf, prompt_ids, budget, max_slice):
    ref, ref_engine = sampled_run(tiny_model, 4096, None, prompt_ids)
    got, engine = sampled_run(tiny_model, budget, max_slice, prompt_ids)
    tokens = {k: [s.output_ids for s in v] for k, v in got.items()}
    assert tokens == {k: [s.output_ids for s in v] for k, v in ref.items()}
    kids = tokens["fork"]
    assert all(len(k) == NEW for k in kids) and len({tuple(k) for k in kids}) > 1, "3 seeds, 3 samples"
    assert tokens["child1-alone"][0] == kids[1]
    assert tokens["greedy"][0] == hf.generate(prompt_ids[1], stop_for(tiny_model)).tokens
    parent, *children = got["fork"]
    assert all(c.seq_id not in engine.prompt_slices for c in children), "forked only after the prompt"
    slice_size = min(budget, max_slice or budget)
    assert engine.prompt_slices[parent.seq_id] == math.ceil(40 / slice_size)  # alone for its whole prompt
    assert ref_engine.prompt_slices[parent.seq_id] == 1
    assert max(engine.step_tokens) <= budget
    assert_no_leak(engine)


# --- 7. graphs on and off -----------------------------------------------------------------------------------


def record_steps(engine: L8Engine) -> list[tuple[bool, bool, bool]]:
    """Per forward: (every row one token wide, any prompt slice, replayed a captured step)."""
    runner, log = engine.runner, []
    inner = runner.forward

    def forward(slices):
        narrow = all(s.num_tokens - s.num_cached == 1 for s in slices)
        prompt = any(not s.decode for s in slices)
        replays = sum(runner.replays.values())
        logits = inner(slices)
        log.append((narrow, prompt, sum(runner.replays.values()) > replays))
        return logits

    runner.forward = forward
    return log


@pytest.mark.task("L8.6")
def test_graphs_on_and_off_agree_and_prompt_slices_run_eagerly(tiny_model, hf, prompt_ids):
    """A one-token prompt ("a") arrives while others decode: every row of that step is one token wide, yet
    it holds a prompt slice, so it runs eagerly; pure decode steps replay."""
    stop = stop_for(tiny_model)
    prompts = [prompt_ids[3][:30], prompt_ids[0], prompt_ids[2], prompt_ids[1]]
    arrivals = [Arrival(p, stop, step=s) for p, s in zip(prompts, [0, 2, 6, 9])]
    on = engine_for(tiny_model, 4, 8, max_running=8, capture_sizes=[1, 2, 4])
    off = engine_for(tiny_model, 4, 8, max_running=8, graphs=False)
    log = record_steps(on)
    got = on.run(arrivals)
    assert got == off.run(arrivals) == [hf.generate(p, stop).tokens for p in prompts]
    assert sum(on.runner.replays.values()) > 0 and not off.runner.replays
    assert off.runner.eager_steps == len(off.step_tokens)
    assert len(log) == len(on.step_tokens) == sum(on.runner.replays.values()) + on.runner.eager_steps
    for narrow, prompt, replayed in log:
        assert replayed == (not prompt and narrow), (narrow, prompt, replayed)
    assert any(narrow and prompt for narrow, prompt, _ in log), "no one-token-wide step with a prompt slice"
    assert_no_leak(on)
    assert_no_leak(off)

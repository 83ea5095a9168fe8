"""L11 on the real tiny model: with drafts, every request's greedy tokens equal HF's for its prompt alone and
L9's (the same engine without speculation, same block size, budget and arrivals); a seeded sampled request with
a one-hot drafter draws exactly L9's seeded tokens. The references are computed in the same run (HF through the
`hf` fixture, L9 here); nothing is a stored token list.

Not the full product of the issue's axes (K 1/2/4/8, block size 1/4/16, budget 1/3/64, staggered arrivals,
prefix hits, forks n = 3, recompute preemption, tp 1/2) but a covering set: every value of every axis at least
once, several pairs, each case checked against both references. The drafters: the replay drafter (HF's own
continuation, corrupted at chosen positions, so rows both accept and reject) for the matrix; the tiny model
drafting for itself (every greedy guess right); the n-gram drafter on prompts whose output repeats itself.
L6+ refuse swap preemption (shared blocks would need ref-counted host blocks), so recompute is the one policy.
"""
from __future__ import annotations

import pytest
import torch

from lessons.l4_continuous.engine import Arrival
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l9_server.engine import L9Engine
from lessons.l11_speculative import L11Engine, L11TpEngine
from lessons.l11_speculative.draft_model import DraftModelDrafter
from lessons.l11_speculative.ngram import NgramDrafter
from lessons.l11_speculative.replay import ReplayDrafter, every_nth_wrong, wrong_with_rate
from shared.errors import CourseError
from shared.generation import StopRule

CPU = torch.device("cpu")
NEW = 12


def stop_for(model, new: int = NEW) -> StopRule:
    return StopRule(new, frozenset(model.config.eos_token_ids), ignore_eos=True)


def l9_engine(model, block_size: int, budget: int = 64, num_blocks: int | None = None, **kwargs) -> L9Engine:
    return L9Engine(model, block_size, num_blocks, backend="torch", max_batched_tokens=budget, **kwargs)


def l11_engine(model, drafter, k: int, block_size: int, budget: int = 64, num_blocks: int | None = None,
               **kwargs) -> L11Engine:
    return L11Engine(model, block_size, num_blocks, backend="torch", max_batched_tokens=budget, drafter=drafter,
                     num_speculative_tokens=k, **kwargs)


def replay(model, hf, prompts: list[list[int]], stop: StopRule, corrupt=every_nth_wrong(2)) -> ReplayDrafter:
    """Proposes HF's continuation of each prompt, wrong where `corrupt` says."""
    return ReplayDrafter({tuple(p): hf.generate(p, stop).tokens for p in prompts}, model.config.vocab_size, corrupt)


def watch_limits(drafter) -> list[int]:
    """Every draft limit the engine asks the drafter for, in order (the list fills as the engine runs)."""
    seen: list[int] = []
    inner = drafter.propose

    def propose(decodes, limits):
        seen.extend(limits)
        return inner(decodes, limits)

    drafter.propose = propose
    return seen


def assert_no_leak(engine) -> None:
    """Every block free or cached once all requests are done; only L7's dummy block is still held."""
    assert engine.allocator.num_free == engine.usable_blocks
    assert [b for b, r in enumerate(engine.allocator.ref) if r] == [engine.dummy_block]


def assert_mixed_acceptance(engine) -> None:
    """Rows both kept and rejected drafts: the verify rule's two branches both ran."""
    s = engine.spec
    assert 0 < s.accepted < s.drafted, s.line()
    assert sum(s.accepted_at) == s.accepted


def decode_accounting(engine, outputs: list[list[int]]) -> None:
    """Every token a step computed is a prompt token, a decode row's own token or a draft: nothing is computed
    twice (no preemption here), and every output token past the first came from a decode row."""
    s = engine.spec
    assert s.emitted == sum(len(o) - 1 for o in outputs)
    assert sum(engine.step_tokens) == engine.stats.prefill_tokens + s.verify_rows + s.plain_rows + s.drafted


# --- 1. the K x block size x budget x arrivals matrix, a covering set -----------------------------------------

MATRIX = [  # (K, block size, budget, stagger): each value of each axis at least once
    (1, 4, 3, 2),
    (2, 1, 64, 1),
    (2, 16, 3, 0),
    (4, 16, 64, 0),
    (4, 1, 3, 1),
    (8, 4, 64, 3),
    (8, 16, 1, 1),  # budget 1: a decode takes the whole step, no draft ever has room
]


@pytest.mark.parametrize("k,block_size,budget,stagger", MATRIX,
                         ids=[f"K{k}-B{b}-budget{t}-stagger{s}" for k, b, t, s in MATRIX])
def test_replay_drafts_keep_parity_with_hf_and_l9(tiny_model, hf, prompt_ids, k, block_size, budget, stagger):
    """The shared prompts, the long one twice (the repeat hits the cache), a request every `stagger` steps.
    Every 2nd output position drafted wrong: rows reject at many positions and keep the rest."""
    stop = stop_for(tiny_model)
    long = prompt_ids[3] if budget > 1 else prompt_ids[3][:40]  # budget 1 feeds one prompt token a step
    short = prompt_ids[:3]
    prompts = [long, short[0], short[1], long, short[2], short[0]]
    want = [hf.generate(p, stop).tokens for p in prompts]
    drafter = replay(tiny_model, hf, prompts, stop)
    limits = watch_limits(drafter)
    engine = l11_engine(tiny_model, drafter, k, block_size, budget)
    got = engine.generate_batch(prompts, stop, stagger=stagger)
    assert got == want
    assert l9_engine(tiny_model, block_size, budget).generate_batch(prompts, stop, stagger=stagger) == want
    assert max(engine.step_tokens) <= budget
    assert engine.stats.cached_tokens > 0, "the repeated long prompt hit the prefix cache"
    assert engine.stats.preemptions == 0
    decode_accounting(engine, got)
    if budget == 1:
        assert engine.spec.drafted == 0 and engine.spec.verify_rows == 0 and not limits
        assert engine.spec.plain_rows == sum(len(o) - 1 for o in got)
    else:
        assert_mixed_acceptance(engine)
        assert max(limits) == min(k, budget - 1), "some decode had room for K drafts, or all the budget left"
        assert len(engine.spec.accepted_at) <= k
    assert_no_leak(engine)


# --- 2. prefix hits on blocks that verified drafts filled --------------------------------------------------------


@pytest.mark.parametrize("drafter_name", ["replay", "draft-model"])
def test_a_prompt_continuing_an_earlier_output_hits_its_verified_blocks(tiny_model, hf, prompt_ids, drafter_name):
    """Request 1 decodes 24 tokens with drafts (blocks of 4: its output fills blocks partly through accepted
    drafts). Request 2, arriving after it finished, is its prompt plus the first 16 output tokens: it hits
    blocks that only decodes wrote, so it reads K/V that verified drafts left. If a block held a rejected
    draft's K/V (or a draft's key), request 2's tokens would differ from HF's."""
    block_size, k = 4, 4
    stop = stop_for(tiny_model, 24)
    first = prompt_ids[0]
    out = hf.generate(first, stop).tokens
    second = first + out[:16]
    if drafter_name == "replay":
        drafter = replay(tiny_model, hf, [first, second], stop, wrong_with_rate(0.3, 5))
    else:
        drafter = DraftModelDrafter(tiny_model, backend="torch")
    engine = l11_engine(tiny_model, drafter, k, block_size)
    arrivals = [Arrival(first, stop, step=0), Arrival(second, stop, step=1000)]  # the second once the first is done
    got = engine.run(arrivals)
    assert got == [out, hf.generate(second, stop).tokens]
    assert l9_engine(tiny_model, block_size).run(arrivals) == got
    hit = engine.stats.cached_tokens
    assert hit == block_size * ((len(second) - 1) // block_size), "every full block of the second prompt hit"
    assert hit > len(first) + block_size, "the hit reaches blocks only decodes filled"
    if drafter_name == "replay":
        assert_mixed_acceptance(engine)
    else:
        assert engine.spec.accepted == engine.spec.drafted > 0, engine.spec.line()
    assert_no_leak(engine)


# --- 3. forks n = 3, seeded: the one-hot rule draws what L9 draws ------------------------------------------------

SEED = 11


def fork_run(engine, prompt_ids, stop: StopRule) -> dict[str, list[list[int]]]:
    """A 40-token prompt forked 3 ways (seeded, top-k 50), a short seeded one and a greedy one a step later."""
    sampling = SamplingParams(temperature=0.8, top_k=50, seed=SEED)
    out: dict[str, list] = {}
    step = 0
    while step < 2 or engine.scheduler.has_work():
        if step == 0:
            out["fork"] = engine.add_parallel(prompt_ids[3][:40], stop, sampling, n=3)
        elif step == 1:
            out["short"] = [engine.add_request(prompt_ids[0], stop, SamplingParams(0.8, top_k=50, seed=SEED + 7))]
            out["greedy"] = [engine.add_request(prompt_ids[1], stop)]
        engine.step()
        step += 1
    return {name: [s.output_ids for s in seqs] for name, seqs in out.items()}


@pytest.mark.parametrize("drafter_name,k,block_size", [("replay", 8, 4), ("draft-model", 2, 16)])
def test_seeded_forks_draw_l9s_tokens(tiny_model, hf, prompt_ids, drafter_name, k, block_size):
    """A one-hot drafter's verify rule samples each row with the request's own generator and keeps a draft
    when it equals the sample: one uniform per emitted token, as without drafts. So every seeded child (and
    the seeded single request) gets L9's exact tokens, not just tokens of the same law. The replay drafter
    replays L9's own samples (child 0's for the shared prompt: the other children reject most of them)."""
    stop = stop_for(tiny_model)
    reference = l9_engine(tiny_model, block_size)
    want = fork_run(reference, prompt_ids, stop)
    kids = want["fork"]
    assert len({tuple(c) for c in kids}) == 3, "3 seeds, 3 different samples"
    assert want["greedy"][0] == hf.generate(prompt_ids[1], stop).tokens
    if drafter_name == "replay":
        expected = {tuple(prompt_ids[3][:40]): kids[0], tuple(prompt_ids[0]): want["short"][0],
                    tuple(prompt_ids[1]): want["greedy"][0]}
        drafter = ReplayDrafter(expected, tiny_model.config.vocab_size, every_nth_wrong(4))
    else:
        drafter = DraftModelDrafter(tiny_model, backend="torch")
    engine = l11_engine(tiny_model, drafter, k, block_size)
    assert fork_run(engine, prompt_ids, stop) == want
    # 40 tokens in blocks of 16 end in a shared partial block: two of its three holders copy it before writing.
    assert engine.stats.cow_copies == reference.stats.cow_copies == (2 if 40 % block_size else 0)
    assert engine.spec.drafted > 0 and engine.spec.accepted > 0, engine.spec.line()
    if drafter_name == "replay":
        assert engine.spec.accepted < engine.spec.drafted
    assert_no_leak(engine)


# --- 4. preemption (recompute) under drafts ------------------------------------------------------------------------


@pytest.mark.parametrize("drafter_name", ["replay", "draft-model"])
def test_recompute_preemption_keeps_parity(tiny_model, hf, prompt_ids, drafter_name):
    """An 8-block pool (blocks of 4) for three requests that need 5 + 8 + 3 blocks at their ends: decodes grow, the
    youngest is preempted and re-prefilled (hitting its own cached blocks). Drafts only take blocks nobody holds
    or caches, so they never cause a preemption, but they run before and after each. The tiny model drafting
    for itself guesses every token right even across preemptions (its own pool is trusted only as far as the
    target's table still matches)."""
    block_size, k, num_blocks, budget = 4, 4, 8, 6
    prompts = [prompt_ids[0], prompt_ids[3][:24], prompt_ids[1]]
    stops = [stop_for(tiny_model, 12), stop_for(tiny_model, 8), stop_for(tiny_model, 8)]
    arrivals = [Arrival(p, s, step=i) for i, (p, s) in enumerate(zip(prompts, stops))]
    want = [hf.generate(p, s).tokens for p, s in zip(prompts, stops)]
    if drafter_name == "replay":
        drafter = ReplayDrafter({tuple(p): w for p, w in zip(prompts, want)}, tiny_model.config.vocab_size,
                                every_nth_wrong(2))
    else:
        drafter = DraftModelDrafter(tiny_model, backend="torch")
    engine = l11_engine(tiny_model, drafter, k, block_size, budget, num_blocks)
    reference = l9_engine(tiny_model, block_size, budget, num_blocks)
    assert engine.run(arrivals) == want
    assert reference.run(arrivals) == want
    assert engine.stats.preemptions > 0 and reference.stats.preemptions > 0
    assert max(engine.step_tokens) <= budget
    if drafter_name == "replay":
        assert_mixed_acceptance(engine)
    else:
        assert engine.spec.accepted == engine.spec.drafted > 0, engine.spec.line()
    assert_no_leak(engine)


def test_swap_preemption_is_refused(tiny_model):
    """L6+ have recompute preemption only: swap is refused at construction, with or without drafts."""
    with pytest.raises(CourseError, match="swap"):
        L11Engine(tiny_model, 4, 8, backend="torch", policy="swap", drafter=NgramDrafter())


# --- 5. the n-gram drafter -------------------------------------------------------------------------------------------


def test_ngram_drafts_on_outputs_that_repeat_themselves(tiny_model, hf, tokenizer):
    """The tiny model has random weights: its greedy output after "a" repeats one token 7 times, and after a
    self-repeating prompt it repeats a pair. Those are the n-grams the drafter finds (2-grams up): it proposes,
    some drafts are kept, and the tokens stay HF's."""
    stop = stop_for(tiny_model, 32)
    prompts = [tokenizer.encode(t).ids for t in ("a", "abc abc abc abc abc abc abc")]
    want = [hf.generate(p, stop).tokens for p in prompts]
    engine = l11_engine(tiny_model, NgramDrafter(), 4, 4)
    assert engine.generate_batch(prompts, stop, stagger=1) == want
    assert l9_engine(tiny_model, 4).generate_batch(prompts, stop, stagger=1) == want
    assert engine.spec.drafted > 0 and engine.spec.accepted > 0, engine.spec.line()
    assert_no_leak(engine)


# --- 6. two ranks --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp_model(tiny_dir):
    """One 2-rank group for the module (one default process group per process); every engine here is built on
    it in turn (each sends the followers a new runner)."""
    from lessons.l10_tensor_parallel.launch import start
    from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM

    group = start(2, CPU, 60)
    try:
        model = TpQwen3ForCausalLM.load(tiny_dir, torch.float32, group)
    except BaseException:
        group.close()
        raise
    yield model
    group.close()


def test_tp2_replay_workload_matches_tp1_l9_and_hf(tp_model, tiny_model, hf, prompt_ids):
    """At tp 2: a long prompt sliced by a budget of 24, short ones arriving while it decodes, a forked seeded
    prompt (n = 3, its copy-on-write made on both ranks) and a later prompt sharing the long one's first 4 blocks
    (a prefix hit). Greedy tokens equal HF's; every output equals one rank's L11 and L9's."""
    block_size, k, budget = 16, 4, 24
    stop = stop_for(tiny_model)
    long, short = prompt_ids[3], prompt_ids[:3]
    sequel = long[:4 * block_size] + prompt_ids[0]
    greedy = [long, short[0], short[2], sequel]
    sampling = SamplingParams(temperature=0.8, top_k=50, seed=SEED)

    def workload(engine) -> list[list[int]]:
        seqs, step = [], 0
        while step <= 10 or engine.scheduler.has_work():
            if step in (0, 1, 3, 10):
                seqs.append(engine.add_request(greedy[[0, 1, 3, 10].index(step)], stop))
            if step == 1:
                seqs += engine.add_parallel(short[1], stop, sampling, n=3)
            engine.step()
            step += 1
        return [s.output_ids for s in seqs]

    want = workload(l9_engine(tiny_model, block_size, budget))
    assert [want[i] for i in (0, 1, 5, 6)] == [hf.generate(p, stop).tokens for p in greedy]
    expected = {tuple(p): hf.generate(p, stop).tokens for p in greedy} | {tuple(short[1]): want[2]}
    drafter = ReplayDrafter(expected, tiny_model.config.vocab_size, wrong_with_rate(0.3, 3))
    one = l11_engine(tiny_model, drafter, k, block_size, budget)
    assert workload(one) == want
    tp = L11TpEngine(tp_model, block_size, None, 64, "torch", max_batched_tokens=budget, drafter=drafter,
                     num_speculative_tokens=k)
    group = tp_model.tp
    reduces = group.calls["all-reduce"]
    assert workload(tp) == want
    assert group.calls["all-reduce"] > reduces, "the ranks computed the workload together"
    assert tp.stats.cached_tokens >= 4 * block_size and tp.stats.cow_copies > 0
    assert max(tp.step_tokens) <= budget
    assert_mixed_acceptance(tp)
    assert (tp.spec.drafted, tp.spec.accepted) == (one.spec.drafted, one.spec.accepted)
    assert tp.step_tokens == one.step_tokens, "the same plan, step for step"
    assert_no_leak(tp)
    assert tp.allocator.pending_copies == []


def test_tp2_draft_model_guesses_every_token(tp_model, tiny_model, hf, prompt_ids):
    """The drafter runs on rank 0 only, the whole tiny model drafting for its split self: every guess right,
    tokens HF's, blocks of 4 and K = 8 (drafts span blocks)."""
    stop = stop_for(tiny_model, 20)
    prompts = prompt_ids
    tp = L11TpEngine(tp_model, 4, None, 64, "torch", drafter=DraftModelDrafter(tiny_model, backend="torch"),
                     num_speculative_tokens=8)
    assert tp.generate_batch(prompts, stop, stagger=2) == [hf.generate(p, stop).tokens for p in prompts]
    assert tp.spec.accepted == tp.spec.drafted > 0, tp.spec.line()
    assert tp.spec.mean_accepted_length > 2
    assert_no_leak(tp)

"""L13's grammars through every path that moves a request's tokens around: each output equals the same request in
a plain run (one engine, no drafts, a roomy pool, a big budget), and each completed output validates.

- Chunked prefill: a slice that does not sample gets no mask row (one mask row per output token).
- Forks (n > 1): sibling i is the request alone with seed + i; siblings diverge, each with its own matcher.
- Recompute preemption: a pool too small for all; the matcher state survives (or is rebuilt from the output).
- Speculation: replayed drafts wrong at every 1st/2nd/3rd position, drafts the grammar forbids, the model
  drafting for itself; greedy and seeded. The drafter proposed, rows rejected, the matcher rolled back.
- Stop ids, ignore_eos (the grammar's EOS still ends the output), and a max_new_tokens that cuts the JSON off.
"""
from __future__ import annotations

import json

import pytest

from lessons.l11_speculative.draft_model import DraftModelDrafter
from lessons.l11_speculative.replay import ReplayDrafter, every_nth_wrong
from lessons.l13_structured import L13Engine
from lessons.l13_structured.engine import matcher_of
from lessons.l13_structured.sampling import ConstrainedSampling
from shared.generation import StopRule
from test_l13_engine import SPECS, assert_valid, drain, eos_of, grammars  # noqa: F401 (a fixture)

NEW = 64
NAMES = ["nested", "person", "code"]  # one grammar per prompt: the replay drafter keys its drafts by prompt


def sampling_for(grammars, name: str, seed: int | None) -> ConstrainedSampling:
    if seed is None:
        return ConstrainedSampling(grammar=grammars[name])
    return ConstrainedSampling(temperature=1.0, top_k=50, seed=seed, grammar=grammars[name])


def run(engine, cases, stop: StopRule) -> list[list[int]]:
    """cases: (grammar name, prompt, seed or None for greedy), all queued at once."""
    seqs = [engine.add_request(prompt, stop, sampling) for prompt, sampling in cases]
    drain(engine)
    return [s.output_ids for s in seqs]


class Plain:
    """Each case's tokens in the plain run, memoised: several tests compare against the same ones."""

    def __init__(self, model):
        self.model, self._memo = model, {}

    def tokens(self, cases, stop: StopRule) -> list[list[int]]:
        missing = [c for c in cases if (tuple(c[0]), c[1], stop) not in self._memo]
        if missing:
            for case, out in zip(missing, run(L13Engine(self.model, 16, max_batched_tokens=512), missing, stop)):
                self._memo[(tuple(case[0]), case[1], stop)] = out
        return [self._memo[(tuple(p), s, stop)] for p, s in cases]


@pytest.fixture(scope="module")
def plain(tiny_model) -> Plain:
    return Plain(tiny_model)


@pytest.fixture(scope="module")
def stop(tiny_model) -> StopRule:
    return StopRule(NEW, eos_of(tiny_model))


def make_cases(grammars, prompts, seed: int | None = None):
    return [(p, sampling_for(grammars, name, None if seed is None else seed + i))
            for i, (name, p) in enumerate(zip(NAMES, prompts))]


def assert_all_valid(tokenizer, outputs, eos) -> None:
    for name, out in zip(NAMES, outputs):
        assert_valid(tokenizer, SPECS[name], out, eos)


# --- chunked prefill ----------------------------------------------------------------------------------------------


def test_chunked_prefill_masks_only_the_slices_that_sample(tiny_model, tokenizer, grammars, prompt_ids, plain, stop):
    """A budget of 8: the 101-token prompt and a 40-token one are fed in slices beside the others' decodes. The
    same tokens as one prefill, and exactly one mask row per output token: no slice that did not sample got one."""
    prompts = [prompt_ids[3], prompt_ids[3][:40] + prompt_ids[1], prompt_ids[0]]
    cases = make_cases(grammars, prompts)
    engine = L13Engine(tiny_model, 16, max_batched_tokens=8)
    got = run(engine, cases, stop)
    assert got == plain.tokens(cases, stop)
    assert max(engine.prompt_slices.values()) > 10 and max(engine.step_tokens) <= 8
    assert engine.masked_rows == sum(len(out) for out in got)
    assert_all_valid(tokenizer, got, eos_of(tiny_model))


# --- forks --------------------------------------------------------------------------------------------------------


def test_forked_siblings_each_follow_their_own_matcher(tiny_model, tokenizer, grammars, prompt_ids, plain, stop):
    """n = 3 with seed 11: sibling i is the request alone with seed 11 + i, beside a greedy constrained request.
    The siblings draw different outputs, each valid, each through a matcher of its own."""
    grammar = grammars["person"]
    engine = L13Engine(tiny_model, 16)
    siblings = engine.add_parallel(prompt_ids[1], stop, sampling_for(grammars, "person", 11), n=3)
    beside = engine.add_request(prompt_ids[0], stop, sampling_for(grammars, "nested", None))
    drain(engine)
    alone = plain.tokens([(prompt_ids[1], sampling_for(grammars, "person", 11 + i)) for i in range(3)], stop)
    assert [s.output_ids for s in siblings] == alone
    assert beside.output_ids == plain.tokens([(prompt_ids[0], sampling_for(grammars, "nested", None))], stop)[0]
    assert len({tuple(s.output_ids) for s in siblings}) == 3, "the siblings diverged"
    matchers = [matcher_of(s) for s in siblings]
    assert len({id(m) for m in matchers}) == 3 and all(s.sampling.grammar is grammar for s in siblings)
    for seq in siblings:
        assert_valid(tokenizer, SPECS["person"], seq.output_ids, eos_of(tiny_model))


# --- preemption by recompute --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 21], ids=["greedy", "seeded"])
def test_recompute_preemption_keeps_the_matcher_state(tiny_model, tokenizer, grammars, prompt_ids, plain, stop, seed):
    """Blocks of 4 and a pool of 13 (52 tokens; one request's prompt + 44 new tokens fits) for three requests
    that need about 20 blocks together: decodes preempt each other and are re-prefilled; each matcher is kept in
    its sequence across it. Every output completes within 44 tokens, so it is the roomy pool's for 64."""
    cases = make_cases(grammars, prompt_ids[:3], seed)
    engine = L13Engine(tiny_model, 4, 13, max_batched_tokens=16)
    got = run(engine, cases, StopRule(44, eos_of(tiny_model)))
    assert engine.stats.preemptions > 0
    assert got == plain.tokens(cases, stop)
    assert_all_valid(tokenizer, got, eos_of(tiny_model))


def test_a_matcher_lost_mid_output_is_rebuilt_from_the_output_so_far(tiny_model, grammars, prompt_ids, plain, stop):
    """Dropping every matcher after 6 steps: the next step makes each again from its output's tokens, and the
    outputs are unchanged."""
    cases = make_cases(grammars, prompt_ids[:3], seed=31)
    engine = L13Engine(tiny_model, 16)
    seqs = [engine.add_request(p, stop, s) for p, s in cases]
    for _ in range(6):
        engine.step()
    assert all(s.output_ids and "matcher" in s.extra for s in seqs)
    for seq in seqs:
        del seq.extra["matcher"]
    drain(engine)
    assert [s.output_ids for s in seqs] == plain.tokens(cases, stop)


# --- speculative decoding -----------------------------------------------------------------------------------------


def watch_drafts_stopped(engine) -> list[int]:
    """[verify groups, groups whose drafts the mask stopped before their end] over the run."""
    counts = [0, 0]
    inner = engine.mask_rows

    def mask_rows(logits, groups):
        taken = inner(logits, groups)
        for (seq, _, piece), count in zip(groups, taken):
            drafts = getattr(piece, "drafts", None)
            if drafts:
                counts[0] += 1
                counts[1] += count < len(drafts)
        return taken

    engine.mask_rows = mask_rows
    return counts


@pytest.mark.parametrize("seed", [None, 41], ids=["greedy", "seeded"])
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_replayed_drafts_with_rejections_give_the_tokens_without_drafts(tiny_model, tokenizer, grammars, prompt_ids,
                                                                       plain, stop, nth, seed):
    """The drafter replays each request's own output, wrong at every nth position (n = 1: every draft wrong).
    Rows accept and reject; each rejection rolls the matcher back. The tokens are the run without drafts."""
    cases = make_cases(grammars, prompt_ids[:3], seed)
    want = plain.tokens(cases, stop)
    expected = {tuple(p): out for (p, _), out in zip(cases, want)}
    engine = L13Engine(tiny_model, 16, drafter=ReplayDrafter(expected, tiny_model.config.vocab_size,
                                                             every_nth_wrong(nth)), num_speculative_tokens=4)
    stopped = watch_drafts_stopped(engine)
    assert run(engine, cases, stop) == want
    spec = engine.spec
    assert spec.drafted > spec.accepted, spec.line()
    assert spec.accepted > 0 if nth > 1 else spec.accepted == 0, spec.line()
    assert stopped[0] > 0 and stopped[1] > 0, "some drafts were forbidden by the grammar itself"
    assert_all_valid(tokenizer, want, eos_of(tiny_model))


@pytest.mark.task("L13.7")
def test_drafts_the_grammar_forbids_are_all_rejected(tiny_model, grammars, prompt_ids, plain, stop):
    """Drafts of tokens 1000, 1001, ... (text no grammar here starts with): the mask stops every proposal at its
    first draft, nothing is accepted, and the tokens are the run without drafts."""
    cases = make_cases(grammars, prompt_ids[:3])
    garbage = {tuple(p): list(range(1000, 1000 + NEW)) for p, _ in cases}
    for name in NAMES:
        assert grammars[name].matcher().validate_tokens([1000]) == 0, "token 1000 cannot start the output"
    engine = L13Engine(tiny_model, 16, drafter=ReplayDrafter(garbage, tiny_model.config.vocab_size),
                       num_speculative_tokens=3)
    stopped = watch_drafts_stopped(engine)
    assert run(engine, cases, stop) == plain.tokens(cases, stop)
    assert engine.spec.drafted > 0 and engine.spec.accepted == 0, engine.spec.line()
    assert stopped[0] == stopped[1] > 0


def test_the_model_drafting_for_itself_gives_the_tokens_without_drafts(tiny_model, grammars, prompt_ids, plain,
                                                                      stop):
    """The tiny model as its own draft model guesses its unconstrained argmax; where the grammar forbids that,
    the row rejects it. The tokens are the run without drafts."""
    cases = make_cases(grammars, prompt_ids[:3])
    engine = L13Engine(tiny_model, 16, drafter=DraftModelDrafter(tiny_model), num_speculative_tokens=2)
    assert run(engine, cases, stop) == plain.tokens(cases, stop)
    assert engine.spec.drafted > engine.spec.accepted, engine.spec.line()


# --- stop ids, ignore_eos, length ---------------------------------------------------------------------------------


def test_a_stop_id_ends_a_constrained_output_early(tiny_model, tokenizer, grammars, prompt_ids, plain, stop):
    """A stop id taken from the middle of the plain output: the output is the plain one up to its first
    occurrence (kept), an unfinished JSON."""
    case = (prompt_ids[0], sampling_for(grammars, "nested", None))
    full = plain.tokens([case], stop)[0]
    token = full[6]
    engine = L13Engine(tiny_model, 16)
    seq = engine.add_request(prompt_ids[0], stop, ConstrainedSampling(grammar=grammars["nested"],
                                                                      stop_token_ids=frozenset({token})))
    drain(engine)
    assert seq.output_ids == full[:full.index(token) + 1]
    assert seq.output_ids[-1] not in eos_of(tiny_model)
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(seq.output_ids))


@pytest.mark.task("L13.7")
def test_ignore_eos_still_ends_at_the_grammars_eos(tiny_model, grammars, prompt_ids, plain, stop):
    """ignore_eos: an unconstrained request runs to max_new_tokens, a constrained one still ends where its
    grammar completes (its EOS is a stop id of the request)."""
    cases = make_cases(grammars, prompt_ids[:3])
    want = plain.tokens(cases, stop)
    ignoring = StopRule(NEW, eos_of(tiny_model), ignore_eos=True)
    engine = L13Engine(tiny_model, 16)
    seqs = [engine.add_request(p, ignoring, s) for p, s in cases]
    free = engine.add_request(prompt_ids[0], StopRule(12, eos_of(tiny_model), ignore_eos=True))
    drain(engine)
    assert [s.output_ids for s in seqs] == want
    assert all(len(out) < NEW and out[-1] in eos_of(tiny_model) for out in want)
    assert len(free.output_ids) == 12


def test_max_new_tokens_cuts_the_json_off_and_finishes_by_length(tiny_model, tokenizer, grammars, prompt_ids,
                                                                plain, stop):
    """6 tokens for a JSON that needs more: the first 6 of the plain output, no EOS, not parseable; what
    engine_loop reports as finish_reason "length" (the last token is none of the request's stop ids)."""
    case = (prompt_ids[0], sampling_for(grammars, "nested", None))
    full = plain.tokens([case], stop)[0]
    assert len(full) > 6
    engine = L13Engine(tiny_model, 16)
    seq = engine.add_request(prompt_ids[0], StopRule(6, eos_of(tiny_model)), case[1])
    drain(engine)
    assert seq.output_ids == full[:6]
    assert seq.output_ids[-1] not in seq.sampling.stop_token_ids and eos_of(tiny_model) <= seq.sampling.stop_token_ids
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(seq.output_ids))


# --- all at once --------------------------------------------------------------------------------------------------


def test_slices_forks_preemption_and_drafts_at_once(tiny_model, tokenizer, grammars, prompt_ids):
    """Blocks of 4, a pool of 20, a budget of 8, replayed drafts wrong at every 2nd position: a 30-token prompt
    sliced, a seeded fork (n = 2), a sampled regex, an unconstrained sampled request, decodes preempting each
    other. Every output is the plain run's."""
    eos = eos_of(tiny_model)
    stop = StopRule(44, eos)  # 30 + 44 tokens: 19 blocks, so the pool holds any one request
    prompts = [prompt_ids[3][:30], prompt_ids[1], prompt_ids[2], prompt_ids[0]]

    def workload(engine) -> list[list[int]]:
        seqs = [engine.add_request(prompts[0], stop, sampling_for(grammars, "nested", None))]
        seqs += engine.add_parallel(prompts[1], stop, sampling_for(grammars, "person", 3), n=2)
        seqs.append(engine.add_request(prompts[2], stop, ConstrainedSampling(temperature=0.8, seed=5,
                                                                             grammar=grammars["code"])))
        seqs.append(engine.add_request(prompts[3], StopRule(20, eos), ConstrainedSampling(temperature=1.0, seed=8)))
        drain(engine)
        return [s.output_ids for s in seqs]

    want = workload(L13Engine(tiny_model, 16, max_batched_tokens=512))
    expected = {tuple(p): want[i] for p, i in zip(prompts, (0, 1, 3, 4))}  # the fork's first sibling for its prompt
    engine = L13Engine(tiny_model, 4, 20, max_batched_tokens=8, num_speculative_tokens=3,
                       drafter=ReplayDrafter(expected, tiny_model.config.vocab_size, every_nth_wrong(2)))
    assert workload(engine) == want
    assert engine.stats.preemptions > 0 and max(engine.prompt_slices.values()) > 1
    assert 0 < engine.spec.accepted < engine.spec.drafted, engine.spec.line()
    for name, out in zip(["nested", "person", "person", "code"], want):
        assert_valid(tokenizer, SPECS[name], out, eos)

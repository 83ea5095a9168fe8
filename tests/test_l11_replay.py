"""L11 with the replay drafter: the test decides exactly which draft of a proposal is wrong, so each rule of the
verify step (how many tokens a row emits, the bonus token, the rollback of blocks, stops inside kept drafts,
the draft cap from max_tokens) is checked at the step where it acts, and the whole output against L9's.

The expected output each drafter replays is L9's greedy output for the same prompt, computed here; nothing is a
stored token list. A stop *string* inside accepted drafts is cut by the server (L9's engine_loop holds the
text), so it is tested with the server, not here.
"""
from __future__ import annotations

import pytest

from lessons.l2_token_flat.engine import blocks_for
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from lessons.l9_server.engine import L9Engine
from lessons.l11_speculative import L11Engine
from lessons.l11_speculative.replay import ReplayDrafter, every_nth_wrong, wrong_with_rate
from shared.generation import StopRule

K = 4  # drafts per proposal
BLOCK = 4
# 5 tokens: after the prompt step the request holds 6 (positions 0..5); the first verify row feeds position 5
# and drafts 6..9, so its drafts sit in blocks 1 (positions 4..7) and 2 (8..11): they cross a boundary.
PROMPT = [10, 20, 30, 40, 50]
MAX_NEW = 16


def ignore_eos(model, new: int = MAX_NEW) -> StopRule:
    return StopRule(new, frozenset(model.config.eos_token_ids), ignore_eos=True)


def l9_outputs(model, prompts: list[list[int]], stop: StopRule, sampling: SamplingParams = SamplingParams(),
               block_size: int = BLOCK) -> list[list[int]]:
    return L9Engine(model, block_size, backend="torch").generate_batch(prompts, stop, sampling)


def spec_engine(model, expected: dict[tuple[int, ...], list[int]], corrupt=lambda seq, pos: False,
                block_size: int = BLOCK, k: int = K, **kwargs) -> L11Engine:
    drafter = ReplayDrafter(expected, model.config.vocab_size, corrupt)
    return L11Engine(model, block_size, backend="torch", drafter=drafter, num_speculative_tokens=k, **kwargs)


def assert_no_leak(engine: L11Engine) -> None:
    assert engine.allocator.num_free == engine.usable_blocks
    held = [b for b, r in enumerate(engine.allocator.ref) if r]
    assert held == [engine.dummy_block]


def assert_rolled_back(engine: L11Engine, seq) -> None:
    """After a step: the request holds exactly the blocks its committed tokens need, nothing past them; the
    pool holds every committed token but the last (fed next step); nobody else holds a block."""
    assert len(seq.blocks) == blocks_for(seq.num_tokens, engine.block_size)
    assert seq.num_cached == seq.num_tokens - 1
    assert engine.allocator.num_free == engine.usable_blocks - len(seq.blocks)


def drain(engine: L11Engine) -> None:
    while engine.scheduler.has_work():
        engine.step()


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[int]:
    """L9's greedy output for PROMPT: what the replay drafter proposes and what every run must produce."""
    out = l9_outputs(tiny_model, [PROMPT], ignore_eos(tiny_model))[0]
    assert len(out) == MAX_NEW
    return out


# --- rejection at each position of the first proposal -------------------------------------------------------


@pytest.mark.task("L11.7")
@pytest.mark.parametrize("j", range(K + 1), ids=[f"reject-at-{j}" for j in range(K)] + ["all-accepted"])
def test_first_verify_row_keeps_exactly_the_drafts_before_the_wrong_one(tiny_model, expected, j):
    """Step 1 is the prompt (output position 0); step 2's row drafts output positions 1 .. K. Corrupting
    position 1 + j makes draft j the first wrong one: the row emits drafts 0 .. j-1 and the target's own token
    at 1 + j (the true one, not the corrupted draft). j = K corrupts nothing (position 1 + K is the row's bonus
    token, which no draft proposes: the next row starts at 2 + K): all K drafts plus the bonus."""
    engine = spec_engine(tiny_model, {tuple(PROMPT): expected}, corrupt=lambda seq, pos: pos == 1 + j)
    seq = engine.add_request(PROMPT, ignore_eos(tiny_model))
    engine.step()
    assert seq.output_ids == expected[:1]
    assert engine.spec.verify_rows == 0  # the prompt's step has no decode to draft behind

    engine.step()
    assert engine.scheduler.limits == [K]
    s = engine.spec
    assert (s.verify_rows, s.plain_rows, s.drafted, s.accepted, s.emitted) == (1, 0, K, j, j + 1)
    assert s.accepted_at == [1] * j
    assert seq.output_ids == expected[:1 + j + 1]
    assert_rolled_back(engine, seq)

    drain(engine)
    assert seq.output_ids == expected
    assert_no_leak(engine)


def test_all_accepted_gives_k_plus_one_tokens_per_step(tiny_model, expected):
    """Nothing corrupted: every verify row keeps its K drafts and adds the target's bonus token, so the output
    grows by K + 1 per step; the last row's drafts shrink to what max_tokens leaves (16 = 1 + 5 + 5 + 5)."""
    engine = spec_engine(tiny_model, {tuple(PROMPT): expected})
    seq = engine.add_request(PROMPT, ignore_eos(tiny_model))
    growth = []
    while engine.scheduler.has_work():
        before = len(seq.output_ids)
        engine.step()
        growth.append(len(seq.output_ids) - before)
        if seq.status is not Status.FINISHED:
            assert_rolled_back(engine, seq)
    assert growth == [1, K + 1, K + 1, K + 1]
    assert seq.output_ids == expected
    s = engine.spec
    assert (s.verify_rows, s.drafted, s.accepted, s.emitted) == (3, 3 * K, 3 * K, 3 * (K + 1))
    assert s.accepted_at == [3] * K and s.mean_accepted_length == K + 1
    assert engine.step_tokens[1:] == [K + 1] * 3  # each verify row fed its last token and K drafts
    assert_no_leak(engine)


# --- the pages: drafts across a block boundary, then rolled back --------------------------------------------


class WatchedReplay(ReplayDrafter):
    """The replay drafter, noting what each proposal saw: the limits, and the request's table and pool state
    (the scheduler has reserved the drafts' blocks by then)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[dict] = []

    def propose(self, decodes, limits):
        self.calls.append({"outputs": [len(p.seq.output_ids) for p in decodes], "limits": list(limits),
                           "blocks": [len(p.seq.blocks) for p in decodes]})
        return super().propose(decodes, limits)


@pytest.mark.task("L11.7")
@pytest.mark.parametrize("j,blocks_after", [(0, 2), (1, 2), (2, 3), (K, 3)])
def test_drafts_across_a_block_boundary_roll_back_to_the_kept_end(tiny_model, expected, j, blocks_after):
    """The first verify row feeds position 5 and drafts 6 .. 9: its table grows to blocks_for(10) = 3 blocks
    for the step. After the row keeps j drafts the request has 1 + j + 1 outputs, 5 + 2 + j tokens: with j <= 1
    block 2 (positions 8 .. 11) held only rejected drafts and goes back to the pool; with j >= 2 a committed
    token lives in it (the target's correction at position 8 when j = 2, kept drafts when j = K) and it stays."""
    drafter = WatchedReplay({tuple(PROMPT): expected}, tiny_model.config.vocab_size, lambda seq, pos: pos == 1 + j)
    engine = L11Engine(tiny_model, BLOCK, backend="torch", drafter=drafter, num_speculative_tokens=K)
    seq = engine.add_request(PROMPT, ignore_eos(tiny_model))
    engine.step()
    assert len(seq.blocks) == blocks_for(len(PROMPT) + 1, BLOCK) == 2
    free_before = engine.allocator.num_free
    engine.step()
    assert drafter.calls[0] == {"outputs": [1], "limits": [K], "blocks": [blocks_for(len(PROMPT) + 1 + K, BLOCK)]}
    assert drafter.calls[0]["blocks"] == [3]
    assert seq.num_tokens == len(PROMPT) + 2 + j
    assert len(seq.blocks) == blocks_after == blocks_for(seq.num_tokens, BLOCK)
    assert engine.allocator.num_free == free_before - (blocks_after - 2)  # a rejected-only block came back
    assert_rolled_back(engine, seq)
    drain(engine)
    assert seq.output_ids == expected
    assert_no_leak(engine)


# --- stops inside accepted drafts -----------------------------------------------------------------------------


def stop_position(expected: list[int]) -> int:
    """An output position inside the first verify row's drafts (positions 1 .. K) with drafts after it, whose
    token did not occur earlier in the output (so L9 stops there and nowhere before)."""
    for p in range(2, K):
        if expected[p] not in expected[:p]:
            return p
    pytest.fail(f"no fresh token at output positions 2 .. {K - 1} of {expected}")


@pytest.mark.task("L11.7")
@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_a_stop_inside_accepted_drafts_cuts_the_output_where_l9_does(tiny_model, expected, how):
    """The stop token is draft p-1 of the first verify row, with drafts after it that the target would also
    accept: the output ends at the stop token exactly as L9's with the same stop, in the same step, and the
    drafts past it leave no block and no token behind."""
    p = stop_position(expected)
    token = expected[p]
    if how == "eos":
        stop, sampling = StopRule(MAX_NEW, frozenset({token}), ignore_eos=False), SamplingParams()
    else:
        stop, sampling = ignore_eos(tiny_model), SamplingParams(stop_token_ids=frozenset({token}))
    reference = l9_outputs(tiny_model, [PROMPT], stop, sampling)[0]
    assert reference == expected[:p + 1]

    engine = spec_engine(tiny_model, {tuple(PROMPT): expected})
    seq = engine.add_request(PROMPT, stop, sampling)
    engine.step()
    finished = engine.step()
    assert finished == [seq] and seq.status is Status.FINISHED
    assert seq.output_ids == reference
    assert engine.spec.drafted == K and engine.spec.verify_rows == 1
    assert not engine.scheduler.has_work()
    assert_no_leak(engine)


@pytest.mark.parametrize("max_new", range(1, 12))
def test_max_tokens_caps_the_drafts_and_the_output(tiny_model, expected, max_new):
    """Every draft right: the output is exactly max_new tokens, L9's, and no proposal was allowed more than
    max_new - len(output) - 1 drafts (the target's own token follows them), so no step computes a token
    past max_tokens. Some max_new make the cap bite below K (for example 8: 1, then 5, then 1 draft + 1)."""
    stop = ignore_eos(tiny_model, max_new)
    drafter = WatchedReplay({tuple(PROMPT): expected}, tiny_model.config.vocab_size)
    engine = L11Engine(tiny_model, BLOCK, backend="torch", drafter=drafter, num_speculative_tokens=K)
    seq = engine.add_request(PROMPT, stop)
    while engine.scheduler.has_work():
        before = len(seq.output_ids)
        engine.step()
        assert all(k <= max(max_new - before - 1, 0) for k in engine.scheduler.limits)
        assert len(seq.output_ids) <= max_new
    assert seq.output_ids == expected[:max_new] == l9_outputs(tiny_model, [PROMPT], stop)[0]
    for call in drafter.calls:
        assert call["limits"] == [min(K, max_new - call["outputs"][0] - 1)]
    assert engine.spec.accepted == engine.spec.drafted  # every draft proposed was kept: the cap cut none short
    assert_no_leak(engine)
    if max_new == 8:
        assert [c["limits"] for c in drafter.calls] == [[K], [1]]


# --- many requests at once --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,corrupt", [("every-3rd", every_nth_wrong(3)), ("rate-0.4", wrong_with_rate(0.4, 7))],
                         ids=["every-3rd", "rate-0.4"])
def test_a_batch_with_rejections_everywhere_gives_l9s_outputs(tiny_model, prompt_ids, name, corrupt):
    """The four shared prompts (one spans many blocks) arriving a step apart, rejections at many positions of
    many rows: every output is L9's, and the pool comes back whole."""
    stop = ignore_eos(tiny_model, 12)
    want = l9_outputs(tiny_model, prompt_ids, stop)
    engine = spec_engine(tiny_model, {tuple(p): o for p, o in zip(prompt_ids, want)}, corrupt)
    assert engine.generate_batch(prompt_ids, stop, stagger=1) == want
    s = engine.spec
    assert 0 < s.accepted < s.drafted
    assert sum(s.accepted_at) == s.accepted
    assert_no_leak(engine)


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_drafts_take_only_the_budget_the_step_leaves(tiny_model, budget):
    """Two requests a step apart, every draft right, token budgets below K + 1: no step computes more than the
    budget (a decode with k drafts costs k + 1), budget 1 leaves no room for any draft, and the outputs are L9's."""
    prompts = [PROMPT, [7, 8, 9]]
    stop = ignore_eos(tiny_model, 12)
    want = l9_outputs(tiny_model, prompts, stop)
    engine = spec_engine(tiny_model, {tuple(p): o for p, o in zip(prompts, want)}, max_batched_tokens=budget)
    assert engine.generate_batch(prompts, stop, stagger=1) == want
    assert max(engine.step_tokens) <= budget
    assert (engine.spec.drafted == 0) == (budget == 1)
    assert engine.spec.accepted == engine.spec.drafted
    assert_no_leak(engine)


@pytest.mark.task("L11.7")
@pytest.mark.parametrize("name,corrupt", [("none-wrong", lambda seq, pos: False), ("every-3rd", every_nth_wrong(3))],
                         ids=["none-wrong", "every-3rd"])
def test_seeded_sampling_with_drafts_gives_l9s_tokens(tiny_model, name, corrupt):
    """Sampled (temperature 0.9, top-k 40), each request with its engine-derived seed: replaying L9's own
    sampled output is accepted in full (the one-hot rule draws what L9 drew, one uniform per token), corrupted
    drafts are rejected, and either way the tokens are L9's."""
    prompts = [PROMPT, [7, 8, 9]]
    stop, sampling = ignore_eos(tiny_model), SamplingParams(temperature=0.9, top_k=40)
    want = l9_outputs(tiny_model, prompts, stop, sampling)
    engine = spec_engine(tiny_model, {tuple(p): o for p, o in zip(prompts, want)}, corrupt)
    assert engine.generate_batch(prompts, stop, sampling) == want
    s = engine.spec
    assert s.drafted > 0
    assert (s.accepted == s.drafted) == (name == "none-wrong")
    assert_no_leak(engine)

"""L11's drafters on their own: the n-gram drafter's lookup rule on hand-made token streams (the embedded model's
random-weight outputs almost never repeat, so on real prompts it proposes nearly nothing), its incremental index
against a brute-force search, and the draft-model drafter's pool bookkeeping: what it trusts after a new block
table or a rejected draft, and that a wrong draft pool costs acceptance, never a token."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from lessons.l4_continuous.sequence import Sequence
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l9_server.engine import L9Engine
from lessons.l11_speculative import L11Engine
from lessons.l11_speculative.draft_model import DraftModelDrafter
from lessons.l11_speculative.ngram import NgramDrafter
from shared.errors import CourseError
from shared.generation import StopRule
from shared.model import Qwen3ForCausalLM

BLOCK = 4


def request(tokens: list[int], num_prompt: int | None = None) -> Sequence:
    """A running request holding `tokens` (the first num_prompt of them its prompt, by default all but one)."""
    num_prompt = len(tokens) - 1 if num_prompt is None else num_prompt
    return Sequence(list(tokens[:num_prompt]), BLOCK, output_ids=list(tokens[num_prompt:]))


def decode(seq: Sequence) -> Slice:
    """The request's decode slice, as L8's plan hands it to a drafter: its last token is not in the pool yet."""
    seq.num_cached = seq.num_tokens - 1
    return Slice.of(seq, 1, decode=True)


def ngram(seq: Sequence, k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    draft = NgramDrafter(max_n, min_n).propose([decode(seq)], [k])[0]
    assert draft.probs is None  # proposed with certainty: the engine verifies it with the one-hot rule
    return draft.tokens


def brute_force(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The rule read literally: for n from max_n down to min_n, the most recent earlier occurrence of the last
    n tokens (one that ends before the last token), and up to k tokens that followed it."""
    total = len(tokens)
    for n in range(min(max_n, total), min_n - 1, -1):
        suffix = tokens[total - n:]
        for end in range(total - 2, n - 2, -1):  # end: the occurrence's last position, latest first
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:min(end + 1 + k, total)]
    return []


# --- the n-gram drafter -------------------------------------------------------------------------------------------


@pytest.mark.task("L11.1")
def test_ngram_proposes_what_followed_the_most_recent_occurrence():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 7, 1, 2, 8, 9, 1, 2]  # the suffix (1, 2) occurred ending at 2 and at 5: 5 is the latest
    assert ngram(request(tokens), 4, max_n=2) == [8, 9, 1, 2]
    assert ngram(request(tokens), 4, max_n=2) == brute_force(tokens, 4, 2, 2)


@pytest.mark.task("L11.1")
def test_ngram_prefers_the_longest_match():
    tokens = [7, 1, 2, 3, 5, 1, 2, 4, 7, 1, 2]  # (7, 1, 2) only at 0..2; (1, 2) most recently at 5..6
    assert ngram(request(tokens), 3, max_n=3) == [3, 5, 1]
    assert ngram(request(tokens), 3, max_n=2) == [4, 7, 1]
    assert ngram(request(tokens), 3, max_n=4, min_n=3) == [3, 5, 1]


@pytest.mark.task("L11.1")
def test_ngram_proposes_nothing_without_a_match():
    assert ngram(request([1, 2, 3, 4, 5, 6]), 4) == []
    assert ngram(request([1, 2, 3, 9, 2, 3, 1, 3]), 4) == []  # 3 recurs, but no 2-gram does
    assert ngram(request([1, 2, 3, 9, 2, 3, 1, 3]), 4, min_n=1) == [1, 3]  # min_n = 1: the last 3 alone, latest at 5
    assert ngram(request([4]), 4, max_n=1, min_n=1) == []  # one token: nothing earlier to match
    assert ngram(request([4, 4, 4]), 0) == []  # no room for drafts: nothing asked


@pytest.mark.task("L11.1")
def test_ngram_caps_at_k_and_at_the_known_tokens():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    for k in range(1, 8):
        assert ngram(request(tokens), k) == [3, 4, 5, 6, 1, 2][:k]
    # The match ends just before the suffix: only the tokens that exist follow it, never a guess past them.
    assert ngram(request([1, 2, 1, 2]), 4) == [1, 2]
    assert ngram(request([9, 1, 2, 1, 2]), 4) == [1, 2]


@pytest.mark.task("L11.1")
def test_ngram_reads_prompt_and_output_as_one_history():
    seq = request([3, 4, 5, 6, 3, 4], num_prompt=3)  # the match is in the prompt, its continuation crosses into output
    assert ngram(seq, 4) == [5, 6, 3, 4]
    seq = request([8, 3, 4, 5, 6, 3, 4], num_prompt=1)  # all of it output
    assert ngram(seq, 4) == [5, 6, 3, 4]


@pytest.mark.task("L11.1")
@pytest.mark.parametrize("max_n,min_n", [(4, 2), (3, 1), (1, 1), (5, 3)])
def test_ngram_incremental_index_equals_a_brute_force_search(max_n, min_n):
    """Random streams over 3 token ids (so matches of every length are common), each request growing by 1 .. 5
    tokens a step as verify steps grow them, two requests per propose call: at every step the drafter, which only
    indexes what was committed since its last call, proposes what the brute-force search over the whole history
    finds."""
    drafter = NgramDrafter(max_n, min_n)
    checked = proposed = 0
    for seed in range(60):
        rng = random.Random(seed)
        # Prompts of 1 .. 12 tokens: the first call indexes a whole prompt at once.
        seqs = [Sequence([rng.randrange(3) for _ in range(rng.randint(1, 12))], BLOCK) for _ in range(2)]
        for _ in range(25):
            limits = [rng.randint(1, 6) for _ in seqs]
            drafts = drafter.propose([decode(seq) for seq in seqs], limits)
            for seq, k, draft in zip(seqs, limits, drafts):
                history = seq.prompt_ids + seq.output_ids
                assert draft.tokens == brute_force(history, k, max_n, min_n), (seed, history, k)
                checked += 1
                proposed += bool(draft.tokens)
                seq.output_ids += [rng.randrange(3) for _ in range(rng.randint(1, 5))]
    assert proposed > checked // 2  # the streams exercise the matches, not only the empty answer


@pytest.mark.parametrize("max_n,min_n", [(2, 0), (0, 0), (2, 3), (-1, -2)])
def test_ngram_refuses_bad_sizes(max_n, min_n):
    with pytest.raises(CourseError, match="n-gram sizes"):
        NgramDrafter(max_n, min_n)


# --- the draft-model drafter: binding -------------------------------------------------------------------------


def meta_model(model: Qwen3ForCausalLM, **changes) -> Qwen3ForCausalLM:
    """A model of another configuration, built without weights: binding reads only its config."""
    with torch.device("meta"):
        return Qwen3ForCausalLM(dataclasses.replace(model.config, **changes))


def test_draft_model_must_share_the_vocabulary_and_cover_the_context(tiny_model):
    with pytest.raises(CourseError, match="vocabulary"):
        L11Engine(tiny_model, BLOCK, backend="torch", drafter=DraftModelDrafter(meta_model(tiny_model, vocab_size=1000)))
    short = tiny_model.config.max_position_embeddings // 2
    with pytest.raises(CourseError, match="context"):
        L11Engine(tiny_model, BLOCK, backend="torch",
                  drafter=DraftModelDrafter(meta_model(tiny_model, max_position_embeddings=short)))
    drafter = DraftModelDrafter(tiny_model, backend="torch")
    engine = L11Engine(tiny_model, BLOCK, backend="torch", drafter=drafter)
    assert drafter.runner.pool.num_blocks == engine.runner.pool.num_blocks  # every target block id is valid there


# --- the draft-model drafter: what its pool is trusted to hold ------------------------------------------------


def drafted(seq: Sequence, blocks: list[int], start: int, fed: list[int]) -> Sequence:
    """As after a proposal: the draft wrote `fed` at positions start .. through the table `blocks`."""
    seq.extra["draft"] = (blocks, start, fed)
    return seq


@pytest.mark.task("L11.8")
def test_trusted_stops_at_the_first_rejected_draft():
    trusted = DraftModelDrafter(None).trusted
    seq = request(list(range(100, 114)), num_prompt=6)  # 14 tokens, blocks of 4: 4 blocks
    seq.blocks = [7, 3, 9, 2]
    assert trusted(seq) == 0  # never drafted: nothing in the draft pool is this request's
    # Drafted at n = 10: fed positions 9 .. 12 (the last committed token, then three guesses).
    assert trusted(drafted(seq, seq.blocks, 9, [109, 110, 111, 112])) == 13  # all kept
    assert trusted(drafted(seq, seq.blocks, 9, [109, 110, 0, 112])) == 11  # the guess at 11 was wrong
    assert trusted(drafted(seq, seq.blocks, 9, [0, 110, 111, 112])) == 9
    # Guesses past the request's end (rejected, then rolled back): only what the request still holds counts.
    assert trusted(drafted(seq, seq.blocks, 12, [112, 113, 5, 6])) == 14


@pytest.mark.task("L11.8")
def test_trusted_stops_at_the_first_block_a_new_table_changed():
    """A table that is a new list (copy-on-write, preemption, a rollback that freed blocks) keeps the draft
    pool's rows only in the blocks both tables still share, from the first block on."""
    trusted = DraftModelDrafter(None).trusted
    seq = request(list(range(100, 114)), num_prompt=6)
    old = [7, 3, 9, 2]
    fed = [109, 110, 111, 112]
    seq.blocks = list(old)  # equal, but a new list: nothing changed
    assert trusted(drafted(seq, old, 9, fed)) == 13
    seq.blocks = [7, 3, 5, 2]  # copy-on-write of block 2 (positions 8 .. 11)
    assert trusted(drafted(seq, old, 9, fed)) == 8
    seq.blocks = [7, 8, 5, 2]  # preempted and readmitted: only block 0 came back (a prefix-cache hit)
    assert trusted(drafted(seq, old, 9, fed)) == 4
    seq.blocks = [6, 3, 9, 2]
    assert trusted(drafted(seq, old, 9, fed)) == 0
    seq.blocks = []  # preempted, not readmitted yet
    assert trusted(drafted(seq, old, 9, fed)) == 0
    seq.blocks = [7, 3, 9]  # a rollback freed block 3: positions 12 .. are not trusted through it
    assert trusted(drafted(seq, old, 9, fed)) == 12
    seq.blocks = [7, 3, 5, 2]  # both at once: the earlier of the two limits
    assert trusted(drafted(seq, old, 9, [109, 0, 111, 112])) == 8
    assert trusted(drafted(seq, old, 5, [105, 0, 107])) == 6


# --- the draft-model drafter in the engine --------------------------------------------------------------------


class WatchedDraft(DraftModelDrafter):
    """The draft-model drafter, noting each proposal's limits and where each request's catch-up started."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits: list[list[int]] = []
        # (request, a new table since its last proposal?, first position this catch-up feeds, that proposal's n)
        self.refeeds: list[tuple[int, bool, int, int]] = []

    def propose(self, decodes, limits):
        self.limits.append(list(limits))
        return super().propose(decodes, limits)

    def catch_up(self, piece):
        seq = piece.seq
        state = seq.extra.get("draft")
        view = super().catch_up(piece)
        if state is not None:
            self.refeeds.append((seq.seq_id, state[0] is not seq.blocks, view.num_cached, state[1]))
        return view


def stop_for(model, new: int) -> StopRule:
    return StopRule(new, frozenset(model.config.eos_token_ids), ignore_eos=True)


@pytest.mark.task("L11.8")
def test_the_model_drafting_for_itself_is_always_right(tiny_model, prompt_ids):
    """The target as its own draft model, greedy, four prompts arriving a step apart: every draft is accepted,
    the outputs are L9's, and the draft ran one forward per draft round: the longest limit of each proposal
    (all requests share each forward)."""
    stop = stop_for(tiny_model, 16)
    want = L9Engine(tiny_model, BLOCK, backend="torch").generate_batch(prompt_ids, stop, stagger=1)
    drafter = WatchedDraft(tiny_model, backend="torch")
    engine = L11Engine(tiny_model, BLOCK, backend="torch", drafter=drafter, num_speculative_tokens=4)
    assert engine.generate_batch(prompt_ids, stop, stagger=1) == want
    s = engine.spec
    assert s.drafted > 0 and s.accepted == s.drafted
    assert drafter.forwards == sum(max(limits) for limits in drafter.limits)
    assert any(len(limits) > 1 for limits in drafter.limits)  # some forwards drafted for several requests
    assert engine.allocator.num_free == engine.usable_blocks

    alone = WatchedDraft(tiny_model, backend="torch")
    engine = L11Engine(tiny_model, BLOCK, backend="torch", drafter=alone, num_speculative_tokens=4)
    assert engine.generate_batch(prompt_ids[:1], stop) == want[:1]
    assert alone.forwards == engine.spec.drafted == engine.spec.accepted  # one request: one draft per forward


def test_after_a_preemption_the_draft_refeeds_from_the_first_changed_block(tiny_model):
    """A pool too small for three requests' 40 tokens each: the newest is preempted mid-decode, with draft
    state, and readmitted with a table that keeps only its first blocks (prefix-cache hits). Its catch-up starts
    at the first block that changed, not where it last drafted, so the draft never reads another request's rows:
    acceptance stays 100% (a trusted() that ignored the new table lost a third of the drafts here when this test
    was written) and the output is L9's."""
    stop = stop_for(tiny_model, 40)
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26], [31, 32, 33]]
    want = L9Engine(tiny_model, BLOCK, 22, backend="torch").generate_batch(prompts, stop, stagger=2)
    drafter = WatchedDraft(tiny_model, backend="torch")
    engine = L11Engine(tiny_model, BLOCK, 22, backend="torch", drafter=drafter)
    assert engine.generate_batch(prompts, stop, stagger=2) == want
    assert engine.stats.preemptions >= 1
    after_new_table = [(start, last) for _, new, start, last in drafter.refeeds if new]
    assert after_new_table, "no request drafted again through a new table"
    assert any(start < last for start, last in after_new_table)  # it went back before its last drafted position
    assert all(start % BLOCK == 0 for start, last in after_new_table if start < last)  # to a block's start
    s = engine.spec
    assert s.accepted == s.drafted > 0
    assert engine.allocator.num_free == engine.usable_blocks


def test_a_garbage_draft_pool_costs_acceptance_never_tokens(tiny_model, prompt_ids):
    """Zero the draft model's whole pool a few steps into a long prompt's decode: its later guesses read K/V
    that is not the request's (it trusts what it wrote), so many are rejected, and the output is still L9's."""
    stop = stop_for(tiny_model, 24)
    prompt = prompt_ids[3]  # 101 tokens
    want = L9Engine(tiny_model, BLOCK, backend="torch").generate_batch([prompt], stop)[0]
    drafter = DraftModelDrafter(tiny_model, backend="torch")
    engine = L11Engine(tiny_model, BLOCK, backend="torch", drafter=drafter)
    seq = engine.add_request(prompt, stop)
    while len(seq.output_ids) < 6:
        engine.step()
    assert engine.spec.accepted == engine.spec.drafted > 0
    before = (engine.spec.drafted, engine.spec.accepted)
    for layer in drafter.runner.pool.k + drafter.runner.pool.v:
        layer.zero_()
    while engine.scheduler.has_work():
        engine.step()
    assert seq.output_ids == want
    drafted, accepted = engine.spec.drafted - before[0], engine.spec.accepted - before[1]
    assert drafted > 0 and accepted < drafted
    assert engine.allocator.num_free == engine.usable_blocks


# --- the early-exit draft: the target's own first layers -----------------------------------------------------------

class RecordingDraft(DraftModelDrafter):
    """Notes, per proposal, the request's committed tokens and the draft's first guess after them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_guesses: list[tuple[list[int], int]] = []

    def propose(self, decodes, limits):
        drafts = super().propose(decodes, limits)
        for piece, draft in zip(decodes, drafts):
            if draft.tokens:
                self.first_guesses.append((piece.seq.token_ids(0, piece.seq.num_tokens), draft.tokens[0]))
        return drafts


def test_early_exit_is_the_targets_first_layers_and_its_guesses_are_the_logit_lens(tiny_model, tiny_dir, prompt_ids):
    """early_exit(model, 2) holds the target's own tensors (nothing copied). As L11's draft model, each first
    guess is what HF's model gives from its first two layers' output through the final norm and LM head (the
    logit lens), on the same tokens; and the output is still L9's, whatever it guesses."""
    from transformers import AutoModelForCausalLM

    from lessons.l11_speculative.early_exit import early_exit

    shallow = early_exit(tiny_model, 2)
    assert shallow.config.num_hidden_layers == 2 and len(shallow.model.layers) == 2
    assert all(a is b for a, b in zip(shallow.model.layers, tiny_model.model.layers))
    assert shallow.lm_head.weight.data_ptr() == tiny_model.lm_head.weight.data_ptr()
    assert shallow.model.embed_tokens is tiny_model.model.embed_tokens and shallow.model.norm is tiny_model.model.norm

    stop = stop_for(tiny_model, 12)
    want = L9Engine(tiny_model, BLOCK, backend="torch").generate_batch(prompt_ids, stop, stagger=1)
    drafter = RecordingDraft(shallow, backend="torch")
    engine = L11Engine(tiny_model, BLOCK, backend="torch", drafter=drafter, num_speculative_tokens=3)
    assert engine.generate_batch(prompt_ids, stop, stagger=1) == want
    assert engine.spec.drafted > 0 and engine.allocator.num_free == engine.usable_blocks

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    checked = drafter.first_guesses[:12]
    assert len(checked) == 12
    with torch.inference_mode():
        for tokens, guess in checked:
            h = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[2][0, -1]
            lens = hf.lm_head(hf.model.norm(h))
            assert guess == int(lens.argmax()), f"after {len(tokens)} tokens: draft guessed {guess}, lens {int(lens.argmax())}"


@pytest.mark.parametrize("layers", [0, 4, -1])
def test_early_exit_refuses_depths_outside_the_target(tiny_model, layers):
    from lessons.l11_speculative.early_exit import early_exit

    with pytest.raises(CourseError, match=rf"--draft-layers must be 1 to 3 \(the target has 4 layers\), got {layers}"):
        early_exit(tiny_model, layers)

"""L13's engine on the embedded model: a grammar's mask on each constrained row, nothing on the others.

- Parity: greedy tokens equal HF `generate` with the grammar's logits processor (a JSON schema with a nested
  object, an array and enums; a regex; a choice list; any JSON object; a Lark grammar), all in one batch with
  an unconstrained request whose tokens are plain HF's. Every completed output validates and ends with EOS.
- 200 seeded sampled requests (four schemas, a regex, a choice list; temperature, top-k, top-p) in big batches
  with unconstrained sampled requests: every constrained output validates, and every unconstrained output is
  the one it gets with no constrained neighbour.
- Rows without a grammar pay nothing (a step with none never builds a mask); a grammar compiled for another
  vocabulary is refused at add_request with the engine unchanged; int8 pages (L12) still give valid outputs.
- Two ranks (L13TpEngine): the masks live on rank 0 and the outputs equal one rank's.
The interactions (chunked prefill, forks, preemption, speculation, stop ids, length) are in
tests/test_l13_interactions.py.
"""
from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest
import torch

from lessons.l12_kv_quant import L12Engine
from lessons.l13_structured import L13Engine
from lessons.l13_structured.grammar import Grammar, GrammarSpec
from lessons.l13_structured.hf_processor import GrammarLogitsProcessor
from lessons.l13_structured.sampling import ConstrainedSampling
from shared.errors import CourseError
from shared.generation import StopRule

# Bounded schemas: every string has a maxLength, every number a range, every array a maxItems, no extra keys,
# so even a random model's output completes in a few dozen tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
NESTED = {  # a nested object, an array of enums, an enum, a boolean
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 6}, "admin": {"type": "boolean"}},
            "required": ["name", "admin"],
            "additionalProperties": False,
        },
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "size": {"enum": ["S", "M", "L"]},
    },
    "required": ["id", "owner", "colors", "size"],
    "additionalProperties": False,
}
FLAG = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4}
CODE = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: "(" item ("," item){0,2} ")"\nitem: "cat" | "dog" | NUM\nNUM: /[0-9]{1,2}/'
LARK_AS_REGEX = r"\((cat|dog|[0-9]{1,2})(,(cat|dog|[0-9]{1,2})){0,2}\)"  # what the Lark grammar accepts

SPECS = {
    "person": GrammarSpec("json_schema", PERSON),
    "nested": GrammarSpec("json_schema", NESTED),
    "flag": GrammarSpec("json_schema", FLAG),
    "digits": GrammarSpec("json_schema", DIGITS),
    "code": GrammarSpec("regex", CODE),
    "choice": GrammarSpec("choice", CHOICES),
    "json_object": GrammarSpec("json_object"),
    "lark": GrammarSpec("grammar", LARK),
}
SHORT_PROMPTS = ["JSON:", "data", "x", "Answer:", "code", "a b", "Q", "out"]  # few tokens: a cheap prefill each


@pytest.fixture(scope="module")
def grammars(grammar_compiler) -> dict[str, Grammar]:
    return {name: grammar_compiler.compile(spec) for name, spec in SPECS.items()}


def eos_of(model) -> frozenset[int]:
    return frozenset(model.config.eos_token_ids)


def drain(engine) -> None:
    while engine.scheduler.has_work():
        engine.step()


def assert_valid(tokenizer, spec: GrammarSpec, output: list[int], eos: frozenset[int]) -> str:
    """The output completed (it ends with EOS) and its text is what the spec asks for. Returns the text."""
    assert output and output[-1] in eos, f"{spec.kind} did not complete: {tokenizer.decode(output)!r}"
    assert not eos & set(output[:-1]), "EOS only at the end"
    text = tokenizer.decode(output[:-1])
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), spec.source)
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif spec.kind == "regex":
        assert re.fullmatch(spec.source, text), text
    elif spec.kind == "choice":
        assert text in spec.source, text
    else:
        assert spec.source == LARK and re.fullmatch(LARK_AS_REGEX, text), text
    return text


# --- parity with HF -----------------------------------------------------------------------------------------------


@pytest.mark.task("L13.7")
def test_greedy_tokens_equal_hf_with_the_grammar_processor(tiny_model, hf, tokenizer, grammars, prompt_ids):
    """Five grammars and one unconstrained request in one batch, greedy: each constrained output is HF
    `generate`'s with GrammarLogitsProcessor of the same grammar (a fresh matcher), token for token; the
    unconstrained one is plain HF's. One mask row per constrained output token, none for the plain request."""
    eos = eos_of(tiny_model)
    stop = StopRule(64, eos)
    cases = [("nested", prompt_ids[0]), ("code", prompt_ids[1]), ("choice", prompt_ids[2]),
             ("json_object", prompt_ids[1]), ("lark", prompt_ids[0])]
    engine = L13Engine(tiny_model, 16)
    seqs = [engine.add_request(p, stop, ConstrainedSampling(grammar=grammars[name])) for name, p in cases]
    plain = engine.add_request(prompt_ids[0], stop)
    drain(engine)
    for (name, prompt), seq in zip(cases, seqs):
        want = hf.ref.generate(prompt, stop, [GrammarLogitsProcessor(grammars[name], len(prompt))]).tokens
        assert seq.output_ids == want, name
        if name == "json_object" and seq.output_ids[-1] not in eos:  # an unbounded object may run out of tokens
            assert len(seq.output_ids) == stop.max_new_tokens
            continue
        assert_valid(tokenizer, SPECS[name], seq.output_ids, eos)
    assert plain.output_ids == hf.generate(prompt_ids[0], stop).tokens
    assert plain.output_ids[:8] != seqs[0].output_ids[:8], "the grammar changed the same prompt's tokens"
    assert engine.masked_rows == sum(len(s.output_ids) for s in seqs)


# --- 200 seeded sampled requests, mixed with unconstrained ones ---------------------------------------------------

MIXED_SCHEMAS = ["person", "flag", "nested", "digits", "code", "choice"]
CONSTRAINED, UNCONSTRAINED, EVERY = 200, 16, 12  # one unconstrained request after every 12th constrained one


def filters(i: int) -> dict:
    """Temperature alone, with top-k, and (one request in ten: sorting 151,936 logits costs about 5 ms a row on
    this CPU) with top-k and top-p. The mask comes first, so each filter acts on allowed tokens only."""
    if i % 10 == 9:
        return dict(temperature=1.3, top_k=20, top_p=0.9)
    return dict(temperature=1.0, top_k=50) if i % 2 else dict(temperature=0.7)


def plain_sampling(i: int) -> ConstrainedSampling:
    return ConstrainedSampling(temperature=1.0, top_k=50, seed=5000 + i)  # no grammar: L4's sampling exactly


def test_200_seeded_sampled_requests_validate_and_leave_their_neighbours_unchanged(tiny_model, tokenizer,
                                                                                   grammars):
    """200 constrained requests (6 grammars, 3 filter settings, each its own seed) and 16 unconstrained ones
    queued together; max_running 64, so most steps hold both kinds. Every constrained output completes and
    validates; each unconstrained output equals the one an engine with only the unconstrained requests gives."""
    eos = eos_of(tiny_model)
    prompts = [tokenizer.encode(p).ids for p in SHORT_PROMPTS]
    stop, plain_stop = StopRule(48, eos), StopRule(24, eos)
    engine = L13Engine(tiny_model, 16, max_running=64, max_batched_tokens=256)
    mixed_steps = watch_mixed_steps(engine)
    constrained, plain = [], []
    for i in range(CONSTRAINED):
        name = MIXED_SCHEMAS[i % len(MIXED_SCHEMAS)]
        sampling = ConstrainedSampling(seed=1000 + i, grammar=grammars[name], **filters(i))
        constrained.append((name, engine.add_request(prompts[i % len(prompts)], stop, sampling)))
        if i % EVERY == 0 and len(plain) < UNCONSTRAINED:
            j = len(plain)
            plain.append(engine.add_request(prompts[j % len(prompts)], plain_stop, plain_sampling(j)))
    drain(engine)
    texts: dict[str, set[str]] = {name: set() for name in MIXED_SCHEMAS}
    for name, seq in constrained:
        texts[name].add(assert_valid(tokenizer, SPECS[name], seq.output_ids, eos))
    assert all(len(drawn) > 1 for drawn in texts.values()), "each grammar's seeds drew different outputs"
    assert mixed_steps[0] >= 10, "constrained and unconstrained rows shared many steps"

    alone = L13Engine(tiny_model, 16, max_running=64, max_batched_tokens=256)
    want = [alone.add_request(prompts[j % len(prompts)], plain_stop, plain_sampling(j)) for j in range(len(plain))]
    drain(alone)
    assert [s.output_ids for s in plain] == [s.output_ids for s in want]
    assert alone.masked_rows == 0


def watch_mixed_steps(engine) -> list[int]:
    """Counts the steps whose sampled rows hold both a constrained and an unconstrained output."""
    count = [0]
    inner = engine.choose

    def choose(logits, groups):
        kinds = {seq.sampling.grammar is not None for seq, _, _ in groups}
        count[0] += kinds == {True, False}
        return inner(logits, groups)

    engine.choose = choose
    return count


# --- rows without a grammar; a grammar for another vocabulary -----------------------------------------------------


def test_rows_without_a_grammar_pay_nothing(tiny_model, prompt_ids, grammars):
    """With no constrained request no step builds a mask (mask_rows raises if called) and the tokens are L12's
    engine's, greedy and seeded; the same engine calls it as soon as a constrained request arrives."""
    stop = StopRule(8, eos_of(tiny_model))
    sampled = ConstrainedSampling(temperature=1.0, seed=3)

    def refuse(logits, groups):
        raise AssertionError("mask_rows ran with no constrained request")

    engine = L13Engine(tiny_model, 16)
    engine.mask_rows = refuse
    seqs = [engine.add_request(prompt_ids[0], stop), engine.add_request(prompt_ids[1], stop, sampled)]
    drain(engine)
    reference = L12Engine(tiny_model, 16)
    want = [reference.add_request(prompt_ids[0], stop), reference.add_request(prompt_ids[1], stop, sampled)]
    drain(reference)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in want]
    assert engine.masked_rows == 0 and engine.mask_seconds == 0
    engine.add_request(prompt_ids[2], stop, ConstrainedSampling(grammar=grammars["choice"]))
    with pytest.raises(AssertionError, match="no constrained request"):
        drain(engine)


def test_a_grammar_for_another_vocabulary_is_refused_with_the_engine_unchanged(tiny_model, tokenizer, grammars,
                                                                              prompt_ids):
    """A grammar for the tokenizer's 151,669 tokens (what a compiler given tokenizer.get_vocab_size() makes)
    instead of the model's 151,936: refused at add_request (CourseError naming both sizes), nothing queued, no
    id used; the request beside it gives the tokens it gives alone."""
    eos = eos_of(tiny_model)
    stop = StopRule(40, eos)
    wrong = copy.copy(grammars["person"])
    wrong.vocab_size = tokenizer.get_vocab_size()
    assert wrong.vocab_size != tiny_model.config.vocab_size
    engine = L13Engine(tiny_model, 16)
    beside = engine.add_request(prompt_ids[0], stop, ConstrainedSampling(grammar=grammars["person"]))
    queued, next_id = len(engine.scheduler.waiting), engine._next_id
    with pytest.raises(CourseError, match=f"{wrong.vocab_size}.*{tiny_model.config.vocab_size}"):
        engine.add_request(prompt_ids[1], stop, ConstrainedSampling(grammar=wrong))
    assert len(engine.scheduler.waiting) == queued and engine._next_id == next_id
    drain(engine)
    alone = L13Engine(tiny_model, 16)
    want = alone.add_request(prompt_ids[0], stop, ConstrainedSampling(grammar=grammars["person"]))
    drain(alone)
    assert beside.output_ids == want.output_ids
    assert_valid(tokenizer, SPECS["person"], beside.output_ids, eos)


# --- L12's int8 pages ---------------------------------------------------------------------------------------------


def test_int8_pages_give_valid_outputs(tiny_model, tokenizer, grammars, prompt_ids):
    """kv_dtype int8 moves the logits a little (no HF parity there), never past the mask: greedy and seeded
    outputs of four grammars all complete and validate."""
    eos = eos_of(tiny_model)
    stop = StopRule(48, eos)
    engine = L13Engine(tiny_model, 16, kv_dtype="int8")
    assert engine.runner.pool.k[0].dtype == torch.int8
    cases = []
    for i, name in enumerate(["nested", "person", "code", "lark"]):
        for sampling in (ConstrainedSampling(grammar=grammars[name]),
                         ConstrainedSampling(temperature=1.0, top_k=50, seed=i, grammar=grammars[name])):
            cases.append((name, engine.add_request(prompt_ids[i % 3], stop, sampling)))
    drain(engine)
    for name, seq in cases:
        assert_valid(tokenizer, SPECS[name], seq.output_ids, eos)


def test_tp2_masks_on_rank_0_give_one_ranks_outputs(tiny_model, tiny_dir, tokenizer, grammars, prompt_ids):
    """L13TpEngine on two ranks: the masks and matchers live on rank 0, the followers only compute. Greedy and
    seeded requests under four grammars, with an unconstrained one beside them: every output equals one rank's
    L13Engine on the same requests, and every constrained one validates."""
    from lessons.l10_tensor_parallel.launch import start
    from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM
    from lessons.l13_structured import L13TpEngine

    eos = eos_of(tiny_model)
    stop = StopRule(48, eos)
    names = ["nested", "person", "code", "choice"]

    def workload(engine) -> list[list[int]]:
        seqs = [engine.add_request(prompt_ids[i % 3], stop, ConstrainedSampling(grammar=grammars[name]))
                for i, name in enumerate(names)]
        seqs.append(engine.add_request(prompt_ids[1], stop, ConstrainedSampling(
            temperature=1.0, top_k=50, seed=7, grammar=grammars["person"])))
        seqs.append(engine.add_request(prompt_ids[0], stop))  # no grammar
        drain(engine)
        return [s.output_ids for s in seqs]

    want = workload(L13Engine(tiny_model, 16))
    group = start(2, torch.device("cpu"), 60)
    try:
        tp = L13TpEngine(TpQwen3ForCausalLM.load(tiny_dir, torch.float32, group), 16)
        reduces = group.calls["all-reduce"]
        got = workload(tp)
        assert group.calls["all-reduce"] > reduces, "the ranks computed the workload together"
    finally:
        group.close()
    assert got == want
    for name, output in zip(names + ["person"], got):
        assert_valid(tokenizer, SPECS[name], output, eos)

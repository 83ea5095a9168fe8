"""L13's request fields (protocol.take_spec) and the server's compile step (server.StructuredOutputs.constrain),
without a server: every accepted shape of response_format and structured_outputs gives the right GrammarSpec
(kind, source, and origin: the field a compile error will name), every bad shape is a 400 whose param and
message name the field; constrain copies the sampling parameters into ConstrainedSampling, turns a compile
error into a 400 naming the field it came from, counts requests, cache hits and failures, and loads the
tokenizer only at the first grammar."""
from __future__ import annotations

import asyncio
import json
import copy
import threading
from collections import OrderedDict
from dataclasses import fields, replace

import pytest
from prometheus_client import CollectorRegistry

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l9_server.protocol import ApiError, GenerationRequest
from lessons.l13_structured import server as server_module
from lessons.l13_structured.grammar import KINDS, GrammarSpec
from lessons.l13_structured.protocol import MAX_CHOICES, STRUCTURED_REFUSED, take_spec
from lessons.l13_structured.sampling import ConstrainedSampling

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}


def spec_of(**fields_) -> GrammarSpec | None:
    """take_spec on a body with `fields_` beside a model and a prompt; checks the rest is left for L9."""
    body = {"model": "m", "prompt": "p", **fields_}
    before = copy.deepcopy(body)
    rest, spec = take_spec(body)
    assert rest == {"model": "m", "prompt": "p"} and body == before  # taken out of a copy, not the caller's dict
    return spec


def refusal(**fields_) -> ApiError:
    with pytest.raises(ApiError) as raised:
        take_spec({"model": "m", **fields_})
    error = raised.value
    assert error.status == 400 and error.param and error.param in error.message, (error.param, error.message)
    return error


# --- accepted shapes --------------------------------------------------------------------------------------

def test_no_fields_is_free_text():
    body = {"model": "m", "prompt": "p"}
    assert take_spec(body) == (body, None)


def test_response_format_text_is_free_text_and_removed():
    assert spec_of(response_format={"type": "text"}) is None
    # text asks for nothing, so it sits beside structured_outputs without a conflict
    assert spec_of(response_format={"type": "text"}, structured_outputs={"regex": "a+"}) == GrammarSpec("regex", "a+")


def test_response_format_json_object():
    spec = spec_of(response_format={"type": "json_object"})
    assert spec == GrammarSpec("json_object") and spec.source is None and spec.origin == "response_format"


@pytest.mark.parametrize("extra", [{}, {"strict": True}, {"strict": False, "description": "a city"}])
def test_response_format_json_schema(extra):
    spec = spec_of(response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, **extra}})
    assert spec == GrammarSpec("json_schema", SCHEMA) and spec.origin == "response_format.json_schema.schema"


@pytest.mark.parametrize("outputs, want", [
    ({"json": SCHEMA}, GrammarSpec("json_schema", SCHEMA, "structured_outputs.json")),
    ({"json": '{"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}'},
     GrammarSpec("json_schema", SCHEMA, "structured_outputs.json")),  # JSON text, as vLLM takes it
    ({"regex": r"\d{3}"}, GrammarSpec("regex", r"\d{3}", "structured_outputs.regex")),
    ({"choice": ["yes", "no"]}, GrammarSpec("choice", ["yes", "no"], "structured_outputs.choice")),
    ({"grammar": 'start: "a"+'}, GrammarSpec("grammar", 'start: "a"+', "structured_outputs.grammar")),
    ({"json_object": True}, GrammarSpec("json_object", None, "structured_outputs.json_object")),
    ({"regex": "a", "json": None, "json_object": False}, GrammarSpec("regex", "a", "structured_outputs.regex")),
])
def test_structured_outputs(outputs, want):
    spec = spec_of(structured_outputs=outputs)
    assert (spec.kind, spec.source, spec.origin) == (want.kind, want.source, want.origin)


def test_choice_is_copied():
    choices = ["a", "b"]
    spec = spec_of(structured_outputs={"choice": choices})
    choices.append("c")
    assert spec.source == ["a", "b"]


# --- refused shapes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, param", [
    ("json", "response_format"),
    (["json_object"], "response_format"),
    ({}, "response_format.type"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "text", "json_schema": {"name": "x", "schema": {}}}, "response_format.json_schema"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "", "schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [SCHEMA]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": 1}},  # 1 == True, not a bool
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "format": "json"}},
     "response_format.json_schema.format"),
])
def test_bad_response_format(value, param):
    assert refusal(response_format=value).param == param


def test_both_fields_refused():
    error = refusal(response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    assert error.param == "structured_outputs" and "response_format" in error.message


@pytest.mark.parametrize("value, param, words", [
    ("a+", "structured_outputs", "must be an object"),
    ({}, "structured_outputs", "got none"),
    ({"json": None, "regex": None}, "structured_outputs", "got none"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs", "got regex, choice"),
    ({"json": SCHEMA, "json_object": True}, "structured_outputs", "got json, json_object"),
    ({"regex": "a", "foo": 1}, "structured_outputs.foo", "unknown field"),
    ({"choice": []}, "structured_outputs.choice", f"1 to {MAX_CHOICES}"),
    ({"choice": "yes"}, "structured_outputs.choice", "list"),
    ({"choice": ["yes", 2]}, "structured_outputs.choice", "strings"),
    ({"choice": ["yes", ""]}, "structured_outputs.choice", "non-empty"),
    ({"choice": [str(i) for i in range(MAX_CHOICES + 1)]}, "structured_outputs.choice", f"1 to {MAX_CHOICES}"),
    ({"json": "{"}, "structured_outputs.json", "not valid JSON"),
    ({"json": "[1]"}, "structured_outputs.json", "JSON schema object"),
    ({"json": 3}, "structured_outputs.json", "JSON schema object"),
    ({"json_object": "yes"}, "structured_outputs.json_object", "must be true"),
    ({"regex": ""}, "structured_outputs.regex", "non-empty string"),
    ({"regex": ["a"]}, "structured_outputs.regex", "non-empty string"),
    ({"regex": 0}, "structured_outputs.regex", "non-empty string"),  # 0 is given (a bad value), not absent
    ({"json_object": 0}, "structured_outputs.json_object", "must be true"),
    ({"grammar": {"lark": "start: x"}}, "structured_outputs.grammar", "non-empty string"),
])
def test_bad_structured_outputs(value, param, words):
    error = refusal(structured_outputs=value)
    assert error.param == param and words in error.message, error.message


@pytest.mark.parametrize("name", sorted(STRUCTURED_REFUSED))
def test_vllm_options_refused_by_name(name):
    # refused whatever the value, even beside a kind this server takes
    error = refusal(structured_outputs={"regex": "a", name: "xgrammar"})
    assert error.param == f"structured_outputs.{name}" and "unsupported" in error.message


def test_refused_names_cover_vllm_options():
    assert {"backend", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
            "structural_tag", "disable_fallback"} <= STRUCTURED_REFUSED


# --- the server's compile step ----------------------------------------------------------------------------

REQUEST = GenerationRequest(
    prompt="hi", max_tokens=8, n=2, stop_strings=("x",), ignore_eos=True, stream=True, include_usage=True,
    return_token_ids=True, continuous_usage=True,
    sampling=SamplingParams(temperature=0.5, top_k=7, top_p=0.8, seed=11, stop_token_ids=frozenset({5, 9})))


@pytest.fixture
def structured(grammar_compiler, tokenizer, monkeypatch):
    """A StructuredOutputs on its own registry whose compiler, when it builds one, shares the session's
    llguidance tokenizer (another would load for seconds) with an empty cache. Returns it, its registry, and
    how many compilers it built."""
    built: list[object] = []

    def compiler(tok, vocab_size, eos_ids):
        assert (tok, vocab_size, eos_ids) == (tokenizer, grammar_compiler.vocab_size, grammar_compiler.eos_ids)
        fresh = copy.copy(grammar_compiler)
        fresh._cache, fresh._lock, fresh.hits, fresh.misses = OrderedDict(), threading.Lock(), 0, 0
        built.append(fresh)
        return fresh

    monkeypatch.setattr(server_module, "GrammarCompiler", compiler)
    registry = CollectorRegistry()
    outputs = server_module.StructuredOutputs(tokenizer, grammar_compiler.vocab_size, grammar_compiler.eos_ids,
                                              registry)
    return outputs, registry, built


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    value = registry.get_sample_value("paged_" + name, labels)
    assert value is not None, name
    return value


def test_constrain_copies_sampling_and_counts(structured):
    outputs, registry, built = structured
    assert not built and outputs._compiler is None  # nothing loaded before the first grammar
    assert all(sample(registry, "structured_requests_total", kind=kind) == 0 for kind in KINDS)

    spec = GrammarSpec("json_schema", SCHEMA, "response_format.json_schema.schema")
    req = asyncio.run(outputs.constrain(REQUEST, spec))
    assert isinstance(req.sampling, ConstrainedSampling) and req.sampling.grammar.spec == spec
    for field in fields(SamplingParams):
        assert getattr(req.sampling, field.name) == getattr(REQUEST.sampling, field.name), field.name
    assert replace(req, sampling=REQUEST.sampling) == REQUEST  # the rest of the request untouched
    assert len(built) == 1
    assert sample(registry, "structured_requests_total", kind="json_schema") == 1
    assert sample(registry, "grammar_compile_seconds_count") == 1
    assert sample(registry, "grammar_cache_hits_total") == 0

    # the same schema from the other field: a cache hit, not a second compile
    same = GrammarSpec("json_schema", json.loads(json.dumps(SCHEMA)), "structured_outputs.json")
    again = asyncio.run(outputs.constrain(REQUEST, same))
    assert again.sampling.grammar is req.sampling.grammar and len(built) == 1
    assert sample(registry, "grammar_cache_hits_total") == 1
    assert sample(registry, "grammar_compile_seconds_count") == 1
    assert sample(registry, "structured_requests_total", kind="json_schema") == 2
    # its keys in another order: another grammar (the output follows a schema's own order), compiled anew
    reordered = GrammarSpec("json_schema", dict(reversed(list(SCHEMA.items()))), "structured_outputs.json")
    other = asyncio.run(outputs.constrain(REQUEST, reordered))
    assert other.sampling.grammar is not req.sampling.grammar
    assert sample(registry, "grammar_compile_seconds_count") == 2
    assert sample(registry, "grammar_compile_failures_total") == 0


@pytest.mark.parametrize("spec, reason", [
    (GrammarSpec("regex", "(ab", "structured_outputs.regex"), "unclosed group"),
    (GrammarSpec("json_schema", {"type": "strin"}, "response_format.json_schema.schema"), "Invalid type: strin"),
    (GrammarSpec("grammar", "start: foo", "structured_outputs.grammar"), 'unknown name: "foo"'),
])
def test_constrain_refuses_what_does_not_compile(structured, spec, reason):
    outputs, registry, _ = structured
    with pytest.raises(ApiError) as raised:
        asyncio.run(outputs.constrain(REQUEST, spec))
    error = raised.value
    assert (error.status, error.param) == (400, spec.origin)
    assert error.message.startswith(f"{spec.kind} cannot be compiled: ") and reason in error.message
    assert sample(registry, "grammar_compile_failures_total") == 1
    assert sample(registry, "structured_requests_total", kind=spec.kind) == 0
    # the server goes on: a good grammar after the bad one
    good = asyncio.run(outputs.constrain(REQUEST, GrammarSpec("choice", ["a", "b"], "structured_outputs.choice")))
    assert good.sampling.grammar is not None
    assert sample(registry, "structured_requests_total", kind="choice") == 1
    assert sample(registry, "grammar_compile_failures_total") == 1


def test_take_is_take_spec(structured):
    outputs, _, built = structured
    rest, spec = outputs.take({"model": "m", "structured_outputs": {"choice": ["a"]}})
    assert rest == {"model": "m"} and spec == GrammarSpec("choice", ["a"]) and not built

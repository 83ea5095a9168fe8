"""L13 follows the standards its clients rely on, whatever other clients sent before.

- A schema's properties come out in the schema's order (OpenAI's structured outputs do), even after a schema
  with the same properties in another order was compiled: the compile cache keys the spec exactly.
- Regexes are ECMA-262's (JSON Schema's `pattern` dialect, and the `regex` field's): `\\d` is `[0-9]`, `\\w`
  `[0-9A-Za-z_]`, `\\s` ECMA's spaces, `.` no line terminator. vLLM's IPv4 test pattern, sampled, writes ASCII
  digits only (Rust's `\\d`, llguidance's default, writes `௧` and `８`).
- A structured-output field nested too deeply is a 400 naming it, never a 500: a JSON string 5,000 brackets
  deep, and a schema past the nesting limit.
"""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from lessons.l9_server.app import create_app
from lessons.l9_server.protocol import ApiError
from lessons.l13_structured import L13Engine
from lessons.l13_structured.ecma import ecma_regex, ecma_schema
from lessons.l13_structured.grammar import MAX_SCHEMA_DEPTH, GrammarSpec
from lessons.l13_structured.protocol import take_spec
from lessons.l13_structured.sampling import ConstrainedSampling
from lessons.l13_structured.server import StructuredOutputs
from shared.errors import CourseError
from shared.generation import StopRule
from test_l9_streams import make_loop, run_with, served  # L9's fake-runner engine loop and ASGI helpers

# vLLM's IPv4 pattern from its structured-output tests
IPV4 = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
SEEDS = range(12)


def small_object(*names: str) -> dict:
    return {"type": "object", "properties": {n: {"type": "integer", "minimum": 0, "maximum": 9} for n in names},
            "required": ["a", "b"], "additionalProperties": False}


def run(model, prompt: list[int], grammars: list, seeds=(None,), max_new: int = 40) -> list[list[int]]:
    """Each grammar once per seed (None: greedy), all in one batch; the outputs without their EOS."""
    engine = L13Engine(model, 16)
    eos = frozenset(model.config.eos_token_ids)
    seqs = [engine.add_request(prompt, StopRule(max_new, eos), ConstrainedSampling(
        grammar=g, temperature=0.0 if seed is None else 1.0, seed=seed)) for g in grammars for seed in seeds]
    while engine.scheduler.has_work():
        engine.step()
    return [[t for t in s.output_ids if t not in eos] for s in seqs]


# --- property order ---------------------------------------------------------------------------------------------


def test_properties_follow_each_schemas_order_whatever_was_compiled_before(tiny_model, tokenizer, grammar_compiler,
                                                                          prompt_ids):
    """The b-first schema is compiled (and served) first; then the a-first one, same properties and `required`.
    Each output opens with its own schema's first property. With the cache keyed by a sorted dump (the bug) the
    a-first request got the b-first grammar and wrote `{"b":` first."""
    b_first = grammar_compiler.compile(GrammarSpec("json_schema", small_object("b", "a")))
    a_first = grammar_compiler.compile(GrammarSpec("json_schema", small_object("a", "b")))
    assert a_first is not b_first, "two schemas that differ in property order share one compiled grammar"
    texts = [tokenizer.decode(t) for t in run(tiny_model, prompt_ids[0], [b_first, a_first])]
    assert [json.loads(t) for t in texts] and texts[0].startswith('{"b":') and texts[1].startswith('{"a":'), (
        f"b-first schema wrote {texts[0]!r}, a-first wrote {texts[1]!r}")


def test_the_cache_key_is_the_spec_in_its_own_order():
    one, other = small_object("a", "b"), small_object("b", "a")
    assert one == other, "the premise: equal as dicts"
    assert GrammarSpec("json_schema", one).key != GrammarSpec("json_schema", other).key
    assert GrammarSpec("json_schema", one).key == GrammarSpec("json_schema", small_object("a", "b")).key


# --- ECMA-262 regexes -------------------------------------------------------------------------------------------


ECMA_CASES = [  # (pattern, text, matches in ECMA-262)
    (r"\d", "7", True), (r"\d", "௧", False), (r"\d", "８", False), (r"\D", "௧", True), (r"\D", "7", False),
    (r"[\d.]+", "1.2", True), (r"[\d.]+", "੭", False), (r"[^\d]", "x", True), (r"[^\d]", "3", False),
    (r"\w", "_", True), (r"\w", "é", False), (r"\W", "é", True), (r"[\w-]+", "a-b_9", True),
    (r"\s", " ", True), (r"\s", "\u00a0", True), (r"\s", "\ufeff", True), (r"\s", "\u2028", True),
    (r"\s", "\u0085", False), (r"\S", "\u0085", True), (r"[^\S]", "\t", True), (r"[^\S]", "x", False),
    (r".", "x", True), (r".", "東", True), (r".", "\r", False), (r".", "\n", False), (r".", "\u2029", False),
    (r"[.]", ".", True), (r"[.]", "x", False), (r"a\.b", "a.b", True), (r"a\.b", "axb", False),
    (r"\u00e9", "é", True), (r"a\/b", "a/b", True),
]


def accepts(grammar, tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text).ids
    m = grammar.matcher()
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


@pytest.mark.parametrize("pattern,text,want", ECMA_CASES, ids=[f"{p}~{t!r}" for p, t, _ in ECMA_CASES])
def test_regex_and_schema_pattern_read_as_ecma_262(grammar_compiler, tokenizer, pattern, text, want):
    """The `regex` field (matched whole) and a schema's `pattern` (anchored here with ^...$) both accept `text`
    exactly when ECMA-262 does."""
    as_regex = accepts(grammar_compiler.compile(GrammarSpec("regex", pattern)), tokenizer, text)
    schema = {"type": "string", "pattern": f"^{pattern}$"}
    as_pattern = accepts(grammar_compiler.compile(GrammarSpec("json_schema", schema)), tokenizer,
                        json.dumps(text, ensure_ascii=False))
    assert (as_regex, as_pattern) == (want, want), (
        f"/{pattern}/ on {text!r}: ECMA-262 says {want}; regex field {as_regex}, schema pattern {as_pattern}")


@pytest.mark.task("L13.3")
def test_ecma_schema_rewrites_subschemas_only():
    """Patterns in properties, items, anyOf, $defs and patternProperties keys are rewritten; a `pattern` that is
    data (inside an enum, a const, a default, or a property *named* pattern) is left alone."""
    schema = {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": r"^\d{5}$"},
                       "pattern": {"type": "string", "default": r"\d"},
                       "tags": {"type": "array", "items": {"anyOf": [{"pattern": r"\w"}, {"$ref": "#/$defs/x"}]}}},
        "$defs": {"x": {"pattern": r"\s"}},
        "patternProperties": {r"^\d+$": {"type": "integer"}},
        "enum": [{"pattern": r"\d"}], "const": {"pattern": r"\d"},
    }
    out = ecma_schema(schema)
    assert out["properties"]["zip"]["pattern"] == r"^[0-9]{5}$"
    assert out["properties"]["pattern"] == schema["properties"]["pattern"]
    assert out["properties"]["tags"]["items"]["anyOf"][0]["pattern"] == "[0-9A-Za-z_]"
    assert out["$defs"]["x"]["pattern"] == ecma_regex(r"\s") != r"\s"
    assert list(out["patternProperties"]) == [r"^[0-9]+$"]
    assert out["enum"] == [{"pattern": r"\d"}] and out["const"] == {"pattern": r"\d"}
    assert schema["properties"]["zip"]["pattern"] == r"^\d{5}$", "the request's own schema is not changed"


def test_vllms_ipv4_regex_writes_ascii_digits(tiny_model, tokenizer, grammar_compiler, prompt_ids):
    """vLLM's IPv4 test pattern through the `regex` kind and through a schema's `pattern`, greedy and 12 seeded
    samples each: every output is an address of ASCII digits and dots (a Python `re.ASCII` full match). Before
    the ECMA rewrite, sampled outputs looked like '௧.８.੭.８'."""
    regex = grammar_compiler.compile(GrammarSpec("regex", IPV4))
    schema = grammar_compiler.compile(GrammarSpec("json_schema", {"type": "string", "pattern": f"^{IPV4}$"}))
    outputs = run(tiny_model, prompt_ids[1], [regex, schema], seeds=(None, *SEEDS), max_new=24)
    texts = [tokenizer.decode(t) for t in outputs]
    bad = [t for t in texts[:len(SEEDS) + 1] if not re.fullmatch(IPV4, t, re.ASCII)]
    bad += [t for t in texts[len(SEEDS) + 1:] if not re.fullmatch(IPV4, json.loads(t), re.ASCII)]
    assert not bad, f"{len(bad)} of {len(texts)} outputs are not ASCII IPv4 addresses: {bad[:4]}"


# --- nesting ---------------------------------------------------------------------------------------------------


def test_a_json_string_nested_5000_deep_is_a_400_naming_the_field():
    with pytest.raises(ApiError) as caught:
        take_spec({"prompt": "x", "structured_outputs": {"json": "[" * 5000 + "]" * 5000}})
    assert caught.value.status == 400 and caught.value.param == "structured_outputs.json", caught.value
    assert "nested too deeply" in str(caught.value)


@pytest.mark.task("L13.5")
def test_a_schema_past_the_nesting_limit_is_refused_in_one_line(grammar_compiler):
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(CourseError, match=f"nests {MAX_SCHEMA_DEPTH + 1} levels deep: at most {MAX_SCHEMA_DEPTH}"):
        grammar_compiler.compile(GrammarSpec("json_schema", deep))
    grammar_compiler.compile(GrammarSpec("json_schema", deep["items"]))  # one level less compiles


def test_the_nesting_repros_over_http_are_400s(tokenizer):
    """The issue's request (a 10 KB body holding a JSON string 5,000 brackets deep) and a schema 65 levels deep
    in `response_format`, sent to the ASGI app in process on L9's fake runner: both 400 naming the field, and a
    plain request beside them completes."""
    loop = make_loop(tokenizer)
    model = served(tokenizer)
    # the fake runner's vocabulary is 64 ids; the compiler gets the embedded model's (the refusals come first)
    structured = StructuredOutputs(tokenizer, 151936, frozenset({151643}), loop.metrics.registry)
    app = create_app(model, loop, structured=structured)
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    base = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app",
                                     timeout=60) as http:
            return await asyncio.gather(
                http.post("/v1/completions", json={**base, "structured_outputs": {"json": "[" * 5000 + "]" * 5000}}),
                http.post("/v1/completions", json={**base, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}}),
                http.post("/v1/completions", json=base))

    string, schema, plain = run_with(loop, main)
    assert string.status_code == 400 and string.json()["error"]["param"] == "structured_outputs.json", string.text
    assert schema.status_code == 400, schema.text
    assert schema.json()["error"]["param"] == "response_format.json_schema.schema", schema.text
    assert "levels deep" in schema.json()["error"]["message"], schema.text
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "length", plain.text

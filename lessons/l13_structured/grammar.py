"""Grammars: what a request asks its output to be, compiled once by llguidance against the model's tokenizer.

A `GrammarSpec` is the request's words (a JSON schema, any JSON object, a regex, a list of choices, a Lark
grammar). `GrammarCompiler.compile` turns it into a `Grammar`: llguidance's grammar text, checked against the
tokenizer, and a matcher in its initial state that every request using it copies. Compiling takes
milliseconds to seconds for a large schema (llguidance lets go of the GIL meanwhile), so the server does it
in a worker thread, never on the engine thread, and keeps the results by spec: the hundredth request with a
schema pays a dictionary lookup and a copy.

JSON is compiled without free whitespace (`{"a":1,"b":[2,3]}`): a grammar that allows any run of spaces lets
a weak model spend its whole budget on them, and compact JSON is what a parser wants anyway.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import llguidance
from tokenizers import Tokenizer

from lessons.l13_structured.ecma import ecma_regex, ecma_schema
from shared.errors import CourseError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
MAX_SCHEMA_DEPTH = 64  # levels of JSON nesting in a schema; llguidance gives up near 100 (a recursion limit)


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. `source` is the schema (a dict), the regex, the choices (a list of strings)
    or the Lark text, as the request gave it; `json_object` has none."""

    kind: str
    source: object = None
    origin: str = field(default="", compare=False)  # the request field it came from, for error messages

    @property
    def key(self) -> str:
        """What the compile cache is keyed by: the spec exactly, its keys in the order given. Never sorted: the
        output writes an object's properties in the schema's order, so two schemas that differ only in that order
        are two grammars (one client's schema must not decide another's output)."""
        return self.kind + ":" + json.dumps(self.source, ensure_ascii=False)


class Grammar:
    """A compiled grammar: copy `matcher()` for each output that must match it."""

    def __init__(self, spec: GrammarSpec, template: llguidance.LLMatcher, vocab_size: int, eos_ids: frozenset[int],
                 compile_seconds: float):
        self.spec, self.vocab_size, self.eos_ids = spec, vocab_size, eos_ids
        self.compile_seconds = compile_seconds
        self._template = template  # never advanced: only copied

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles specs for one tokenizer, keeps the results; safe to call from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        # llguidance reads the tokenizer's own JSON (about 1.4 s for Qwen's 151,669 tokens, once per process).
        # n_vocab is the model's vocabulary (151,936): the ids past the tokenizer's are never allowed.
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self.vocab_size, self.eos_ids = vocab_size, frozenset(eos_ids)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar for `spec`, from the cache when it was compiled before. Raises CourseError naming
        what llguidance could not compile (a bad regex, an unknown type, an unsupported keyword)."""
        return self.lookup(spec)[0]

    # Task L13.5: compile a spec once: validate it, keep the grammar by its key, least recently used dropped first
    def lookup(self, spec: GrammarSpec) -> tuple[Grammar, bool]:
        """(the compiled grammar, whether it came from the cache)."""
        if spec.kind == "json_schema" and (depth := nesting_depth(spec.source)) > MAX_SCHEMA_DEPTH:
            # refused before anything recursive (the key's json.dumps, the ECMA rewrite) walks it
            raise CourseError(f"json_schema nests {depth} levels deep: at most {MAX_SCHEMA_DEPTH}")
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key], True
        start = time.perf_counter()
        try:
            text = grammar_text(spec)
        except ValueError as e:  # llguidance refusing its arguments (it documents ValueError): still the request's fault
            raise CourseError(f"{spec.kind} cannot be compiled: {first_line(str(e))}") from None
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise CourseError(f"{spec.kind} cannot be compiled: {first_line(error)}")
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():  # validation passed, so only a resource limit gets here
            raise CourseError(f"{spec.kind} cannot be compiled: {first_line(template.get_error())}")
        grammar = Grammar(spec, template, self.vocab_size, self.eos_ids, time.perf_counter() - start)
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar, False


# Task L13.4: a spec's llguidance grammar: a JSON schema or any object (compact), a regex, choices, Lark or GBNF
def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for a spec. Shapes are the caller's to check; what is inside, llguidance's."""
    if spec.kind == "json_schema":  # patterns are ECMA-262 regexes (ecma.py)
        return llguidance.LLMatcher.grammar_from_json_schema(ecma_schema(spec.source), defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(ecma_regex(spec.source))  # read as a schema's pattern is
    if spec.kind == "choice":  # each choice a Lark string literal (JSON's escapes are Lark's)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.source))
    if spec.kind == "grammar":  # Lark, or llama.cpp's GBNF (converted to Lark)
        try:
            return llguidance.grammar_from("grammar", spec.source)
        except ValueError as e:
            raise CourseError(f"grammar cannot be compiled: {first_line(str(e))}") from None
    raise CourseError(f"unknown grammar kind {spec.kind!r}: one of {', '.join(KINDS)}")


def first_line(message: str) -> str:
    """llguidance's message in one line: its first, and the regex parser's `error:` line when there is one."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or ["no reason given"]
    why = [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(lines[:1] + why[:1])


def nesting_depth(value: object) -> int:
    """How deeply a parsed JSON value nests (a scalar 0, `[]` 1), walked with a stack: no recursion to run out of."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest

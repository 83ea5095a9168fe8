"""L13's token mask against references that do not use llguidance, and the compiler and HF processor around it.

The brute-force check: for a language small enough to list (a choice list, a JSON schema of enums, consts and
booleans), every complete output is known as bytes, so a token t keeps the output a valid prefix after an
output prefix P exactly when some complete output starts with P + bytes(t); an EOS id is allowed exactly when
P is itself complete; every other special token, and every id past the tokenizer's (the embedding is padded to
151,936), never. For a regex, the `regex` module's partial matching says whether P + bytes(t) can still become
a full match. Token bytes come from L9's byte-level table (TokenBytes), not from llguidance. The whole row of
151,936 ids is compared, at the start and at every prefix along real outputs (canonical tokenizations, and
seeded random walks through the allowed tokens, which pick odd splits).

One documented narrowing: where the grammar forces the next bytes F (every continuation starts with F, and P is
not complete), llguidance may allow only the first token of F's canonical tokenization (its "forced token":
the output keeps the tokenizer's own split, e.g. after `maybe` in a choice list only ` not`, not ` ` or ` n`).
So the mask must equal the brute-force set, or, at a forced stretch only, be exactly that one token, which the
brute force allows too and which the tokenizer itself (not llguidance) names.
"""
from __future__ import annotations

import copy
import itertools
import json
import threading
from collections import OrderedDict

import pytest
import regex
import torch

from lessons.l13_structured import grammar as grammar_module
from lessons.l13_structured import mask
from lessons.l13_structured.grammar import GrammarSpec
from lessons.l13_structured.hf_processor import GrammarLogitsProcessor
from lessons.l9_server.detokenizer import TokenBytes
from shared.errors import CourseError

EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>: the embedded model's eos_token_ids
TOKENIZER_SIZE = 151669  # ids 151669 .. 151935 are padding rows of the embedding: no token at all

# A finite JSON language: 5 * 2 * 1 * 2 = 20 outputs. "x"/"xy" and 3/30 make one value a prefix of another,
# so the mask must keep both a longer value and the separator open at once.
SCHEMA = {
    "type": "object",
    "properties": {
        "b": {"enum": ["x", "xy", 3, 30, None]},
        "a": {"type": "boolean"},
        "c": {"const": "hi"},
        "d": {"type": "object", "properties": {"e": {"enum": [1, 2]}}, "required": ["e"],
              "additionalProperties": False},
    },
    "required": ["b", "a", "c", "d"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "no way", "maybe not"]  # "no" is complete and a prefix of "no way"
# ASCII only; ends open ([xyz]+: EOS and more letters both allowed); few letters keep the reference quick
REGEX = r"(ab|cd)[0-9]{1,3}(-[xyz]+)?"


def schema_outputs() -> list[bytes]:
    """Every output of SCHEMA as llguidance writes JSON here: compact (',' and ':'), keys in schema order."""
    values = {"b": SCHEMA["properties"]["b"]["enum"], "a": [True, False], "c": ["hi"], "d": [{"e": 1}, {"e": 2}]}
    return [json.dumps(dict(zip(values, combo)), separators=(",", ":")).encode()
            for combo in itertools.product(*values.values())]


@pytest.fixture(scope="module")
def token_bytes(tokenizer) -> list[bytes]:
    """Every token id below the tokenizer's size -> its bytes (special tokens: b""), read once per module."""
    table = TokenBytes(tokenizer)
    assert tokenizer.get_vocab_size() == TOKENIZER_SIZE
    return [table(token) for token in range(TOKENIZER_SIZE)]


@pytest.fixture(scope="module")
def by_bytes(token_bytes) -> dict[bytes, list[int]]:
    """Bytes -> the ids that stand for them (specials have none: they stand for no text)."""
    index: dict[bytes, list[int]] = {}
    for token, piece in enumerate(token_bytes):
        if piece:
            index.setdefault(piece, []).append(token)
    return index


class Reference:
    """What the brute force says after one prefix: the tokens that keep it valid, and the bytes it forces."""

    def __init__(self, allowed: torch.Tensor, forced: bytes):
        self.allowed, self.forced = allowed, forced


def finite_reference(outputs: list[bytes], prefix: bytes, by_bytes: dict[bytes, list[int]],
                     vocab_size: int) -> Reference:
    """A listed language after `prefix`. "Some output starts with prefix + bytes(t)" means bytes(t) is a
    non-empty prefix of some output's rest, so looking up each prefix of each rest visits exactly the allowed
    tokens (the same set as trying every token; checked on one case below). Forced: the rests' common prefix,
    unless the prefix is complete (then stopping is an option too)."""
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    rests = [output[len(prefix):] for output in outputs if output.startswith(prefix)]
    pieces = {rest[:end] for rest in rests for end in range(1, len(rest) + 1)}
    allowed[[token for piece in pieces for token in by_bytes.get(piece, [])]] = True
    if prefix in outputs:
        allowed[list(EOS_IDS)] = True
        return Reference(allowed, b"")
    forced = min(rests, default=b"")
    for rest in rests:
        while not rest.startswith(forced):
            forced = forced[:-1]
    return Reference(allowed, forced)


def regex_reference(pattern: str, prefix: str, ascii_tokens: dict[str, list[tuple[int, str]]],
                    vocab_size: int) -> Reference:
    """An ASCII regex after `prefix`: prefix + text(t) must still be able to become a full match. A token with
    any non-ASCII byte (or half a UTF-8 character) can never be allowed, so only ASCII tokens are tried; those
    whose first character already fails are skipped (a partial match's prefixes are partial matches too).
    Forced: the characters that are the only way on, one at a time, until a full match or a choice."""
    compiled = regex.compile(pattern)
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    for first, tokens in ascii_tokens.items():
        if compiled.fullmatch(prefix + first, partial=True) is None:
            continue
        allowed[[t for t, text in tokens if compiled.fullmatch(prefix + text, partial=True)]] = True
    forced = ""
    while compiled.fullmatch(prefix + forced) is None:
        nexts = [chr(c) for c in range(128) if compiled.fullmatch(prefix + forced + chr(c), partial=True)]
        if len(nexts) != 1:
            break
        forced += nexts[0]
    if compiled.fullmatch(prefix) is not None:
        allowed[list(EOS_IDS)] = True
    return Reference(allowed, forced.encode())


def llguidance_row(matcher, vocab_size: int) -> torch.Tensor:
    bitmask = mask.allocate(1, vocab_size)
    mask.fill(matcher, bitmask, 0)
    return mask.allowed_rows(bitmask, vocab_size)[0]


def check_row(got: torch.Tensor, want: Reference, prefix: bytes, tokenizer, token_bytes: list[bytes]) -> str:
    """llguidance's row against the reference: equal ("equal"), or at a forced stretch the one canonical
    token ("forced"). Fails naming the tokens that differ."""
    assert got.shape == want.allowed.shape == (151936,)
    assert not got[TOKENIZER_SIZE:].any()  # the padding ids, explicitly
    if torch.equal(got, want.allowed):
        return "equal"
    allowed = got.nonzero().flatten().tolist()
    if want.forced and len(allowed) == 1:
        canonical = tokenizer.encode(want.forced.decode()).ids[0]
        assert allowed == [canonical] and want.allowed[canonical], \
            f"after {prefix!r}, forced {want.forced!r}: llguidance allows only {token_bytes[allowed[0]]!r}, " \
            f"not the canonical {token_bytes[canonical]!r}"
        return "forced"
    extra = (got & ~want.allowed).nonzero().flatten()[:8].tolist()
    missing = (want.allowed & ~got).nonzero().flatten()[:8].tolist()
    name = lambda t: (t, token_bytes[t] if t < TOKENIZER_SIZE else "pad")  # noqa: E731
    pytest.fail(f"after {prefix!r}: llguidance allows {[name(t) for t in extra]} that the reference does not, "
                f"and forbids {[name(t) for t in missing]} that it allows")


def walks(grammar, start_tokens: list[list[int]], seed: int, random_walks: int, max_steps: int):
    """Token sequences to check the mask along: the given ones, then seeded random walks through the mask."""
    yield from start_tokens
    gen = torch.Generator().manual_seed(seed)
    for _ in range(random_walks):
        matcher, tokens = grammar.matcher(), []
        for _ in range(max_steps):
            allowed = llguidance_row(matcher, grammar.vocab_size).nonzero().flatten()
            token = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
            if token in EOS_IDS:
                break
            assert matcher.consume_token(token)
            tokens.append(token)
        yield tokens


def check_along(grammar, tokens: list[int], reference, tokenizer, token_bytes: list[bytes],
                tally: dict[str, int]) -> None:
    """Compare llguidance's row with `reference(prefix bytes)` before each token and after the last, counting
    in `tally` how each step agreed and the most tokens allowed at one step ("most")."""
    matcher, prefix = grammar.matcher(), b""
    for step in range(len(tokens) + 1):
        got = llguidance_row(matcher, grammar.vocab_size)
        how = check_row(got, reference(prefix), prefix, tokenizer, token_bytes)
        tally[how] = tally.get(how, 0) + 1
        tally["most"] = max(tally.get("most", 0), int(got.sum()))
        if step < len(tokens):
            assert matcher.consume_token(tokens[step])
            prefix += token_bytes[tokens[step]]


def test_choice_mask_equals_brute_force(grammar_compiler, tokenizer, token_bytes, by_bytes):
    grammar = grammar_compiler.compile(GrammarSpec("choice", CHOICES))
    outputs = [c.encode() for c in CHOICES]
    vocab = grammar.vocab_size
    # The shortcut in finite_reference, against trying literally every token, on the empty prefix.
    literal = torch.tensor([bool(b) and any(o.startswith(b) for o in outputs) for b in token_bytes])
    assert torch.equal(finite_reference(outputs, b"", by_bytes, vocab).allowed[:TOKENIZER_SIZE], literal)

    tally: dict[str, int] = {}
    canonical = [tokenizer.encode(c).ids for c in CHOICES]
    for tokens in walks(grammar, canonical, seed=0, random_walks=6, max_steps=20):
        check_along(grammar, tokens, lambda p: finite_reference(outputs, p, by_bytes, vocab), tokenizer,
                    token_bytes, tally)
    assert tally["most"] > 1, "the check would be trivial: never more than one token allowed"
    assert tally["equal"] > tally.get("forced", 0) > 0, tally
    # "no" is complete and goes on: EOS and " way" are both open
    no = grammar.matcher()
    assert no.consume_tokens(tokenizer.encode("no").ids)
    row = llguidance_row(no, vocab)
    assert row[list(EOS_IDS)].all() and row[tokenizer.encode(" way").ids[0]]


def test_json_schema_mask_equals_brute_force(grammar_compiler, tokenizer, token_bytes, by_bytes):
    grammar = grammar_compiler.compile(GrammarSpec("json_schema", SCHEMA))
    outputs = schema_outputs()
    assert len(outputs) == 20 and outputs[0] == b'{"b":"x","a":true,"c":"hi","d":{"e":1}}'
    tally: dict[str, int] = {}
    canonical = [tokenizer.encode(o.decode()).ids for o in outputs]
    for tokens in walks(grammar, canonical, seed=1, random_walks=8, max_steps=40):
        check_along(grammar, tokens, lambda p: finite_reference(outputs, p, by_bytes, grammar.vocab_size),
                    tokenizer, token_bytes, tally)
    assert tally["most"] > 1 and tally["equal"] > 100 and tally["forced"] > 100, tally


def test_regex_mask_equals_partial_matching(grammar_compiler, tokenizer, token_bytes):
    grammar = grammar_compiler.compile(GrammarSpec("regex", REGEX))
    ascii_tokens: dict[str, list[tuple[int, str]]] = {}
    for token, piece in enumerate(token_bytes):
        if piece and piece.isascii():
            text = piece.decode("ascii")
            ascii_tokens.setdefault(text[0], []).append((token, text))
    tally: dict[str, int] = {}
    canonical = [tokenizer.encode(s).ids for s in ("ab1", "cd123-xyz", "ab42-zy")]
    for tokens in walks(grammar, canonical, seed=2, random_walks=4, max_steps=8):
        check_along(grammar, tokens, lambda p: regex_reference(REGEX, p.decode("ascii"), ascii_tokens,
                                                               grammar.vocab_size), tokenizer, token_bytes, tally)
    assert tally["most"] > 1 and tally["equal"] > 5, tally


# --- the bitmask helpers against a naive bit extraction ---------------------------------------------------

def naive_allowed(words: list[int], vocab_size: int) -> list[bool]:
    """Token t: bit t % 32 of word t // 32, the word read as an unsigned 32-bit number."""
    return [bool(((words[t // 32] & 0xFFFFFFFF) >> (t % 32)) & 1) for t in range(vocab_size)]


@pytest.mark.task("L13.1")
@pytest.mark.parametrize("vocab_size", [1, 31, 100, 161])
def test_allowed_rows_and_is_allowed_match_naive_bits(vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    words = (vocab_size + 31) // 32
    bitmask = torch.randint(-2**31, 2**31, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -1  # every bit, the sign bit too
    bitmask[1, -1] = -2**31  # only the sign bit: token 32 * (words - 1) + 31, past the vocabulary unless it fits
    assert (bitmask < 0).any()
    rows = mask.allowed_rows(bitmask, vocab_size)
    assert rows.dtype == torch.bool and rows.shape == (3, vocab_size)
    for r in range(3):
        want = naive_allowed(bitmask[r].tolist(), vocab_size)
        assert rows[r].tolist() == want
        assert [mask.is_allowed(bitmask[r], t) for t in range(vocab_size)] == want


@pytest.mark.task("L13.2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_sets_exactly_the_disallowed_to_minus_inf(dtype):
    vocab_size, gen = 100, torch.Generator().manual_seed(7)
    bitmask = torch.randint(-2**31, 2**31, (4, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(4, vocab_size, generator=gen).to(dtype)
    logits[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])  # odd values are kept as they are
    bitmask[0, 0] |= 0b111
    before = logits.clone()
    mask.apply(logits, bitmask)
    keep = torch.tensor([naive_allowed(row, vocab_size) for row in bitmask.tolist()])
    assert 0 < keep.sum() < keep.numel()
    assert (logits[~keep] == -float("inf")).all()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(logits.view(bits)[keep], before.view(bits)[keep])  # bitwise: NaN included


def test_fill_writes_only_its_row(grammar_compiler):
    grammar = grammar_compiler.compile(GrammarSpec("choice", CHOICES))
    bitmask = mask.allocate(3, grammar.vocab_size)
    assert bitmask.shape == (3, (151936 + 31) // 32) and bitmask.dtype == torch.int32
    bitmask[0] = 12345
    mask.fill(grammar.matcher(), bitmask, 1)
    assert (bitmask[0] == 12345).all() and (bitmask[2] == 0).all() and bitmask[1].any()


# --- the compiler -----------------------------------------------------------------------------------------

@pytest.fixture
def compiler(grammar_compiler):
    """A compiler with an empty cache and zeroed counters that shares the session's llguidance tokenizer
    (loading another takes seconds): the cache tests must not evict or count in the session's."""
    fresh = copy.copy(grammar_compiler)
    fresh._cache, fresh._lock, fresh.hits, fresh.misses = OrderedDict(), threading.Lock(), 0, 0
    return fresh


@pytest.mark.task("L13.5")
def test_cache_hits_the_same_spec_and_keeps_a_reordered_schema_apart(compiler):
    """The same schema from another field is a hit; its properties in another order are another grammar (the
    output writes them in the schema's order: tests/test_l13_standards.py)."""
    reordered = {"additionalProperties": False, "required": ["b", "a", "c", "d"],
                 "properties": dict(reversed(list(SCHEMA["properties"].items()))), "type": "object"}
    first = compiler.compile(GrammarSpec("json_schema", SCHEMA, origin="one"))
    again = compiler.compile(GrammarSpec("json_schema", copy.deepcopy(SCHEMA), origin="other"))
    assert again is first and (compiler.hits, compiler.misses) == (1, 1)
    other = compiler.compile(GrammarSpec("json_schema", reordered, origin="other"))
    assert other is not first and (compiler.hits, compiler.misses) == (1, 2)
    compiler.compile(GrammarSpec("regex", REGEX))
    assert (compiler.hits, compiler.misses) == (1, 3)


@pytest.mark.task("L13.5")
def test_cache_drops_the_least_recently_used(compiler, monkeypatch):
    monkeypatch.setattr(grammar_module, "CACHE_SIZE", 2)
    a, b, c = (GrammarSpec("choice", [word]) for word in ("a", "b", "c"))
    first_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is first_a  # a is now the most recent: b goes first
    compiler.compile(c)
    assert (compiler.hits, compiler.misses) == (1, 3)
    assert compiler.compile(a) is first_a and compiler.hits == 2
    compiler.compile(b)  # dropped: compiled again
    assert (compiler.hits, compiler.misses) == (2, 4)
    assert len(compiler._cache) == 2


@pytest.mark.task("L13.5")
@pytest.mark.parametrize("spec, reason", [
    (GrammarSpec("json_schema", {"type": "strin"}), "Invalid type: strin"),
    (GrammarSpec("json_schema", {"type": "string", "format": "bogus"}), "Unknown format: bogus"),
    (GrammarSpec("regex", "(ab"), "unclosed group"),
    (GrammarSpec("grammar", "start: foo"), 'unknown name: "foo"'),
    (GrammarSpec("grammar", 'root ::= "a" | ('), "GBNF"),
    (GrammarSpec("grammar", "root ::= foo"), "Rule 'foo' not found"),
])
def test_compile_errors_are_one_line_and_name_the_problem(compiler, spec, reason):
    with pytest.raises(CourseError) as raised:
        compiler.compile(spec)
    message = str(raised.value)
    assert message.startswith(f"{spec.kind} cannot be compiled: ") and reason in message
    assert "\n" not in message
    assert compiler.misses == 0 and not compiler._cache  # nothing half-made is kept


@pytest.mark.task("L13.5")
@pytest.mark.parametrize("spec, text", [
    (GrammarSpec("json_schema", SCHEMA), '{"b":null,"a":false,"c":"hi","d":{"e":2}}'),
    (GrammarSpec("json_object"), '{"k":[1,{"z":null}]}'),
    (GrammarSpec("regex", REGEX), "cd7-xy"),
    (GrammarSpec("choice", CHOICES), "maybe not"),
    (GrammarSpec("grammar", 'start: "a" ("b" | "c")+'), "abcb"),  # Lark
    (GrammarSpec("grammar", 'root ::= "a" [bc]+'), "abcb"),  # GBNF
])
def test_each_kind_compiles_and_accepts_an_output(compiler, tokenizer, spec, text):
    grammar = compiler.compile(spec)
    assert grammar.spec == spec and grammar.eos_ids == frozenset(EOS_IDS) and grammar.compile_seconds >= 0
    matcher = grammar.matcher()
    assert matcher.consume_tokens(tokenizer.encode(text).ids) and matcher.is_accepting()


def test_matchers_are_independent_copies(grammar_compiler, tokenizer):
    grammar = grammar_compiler.compile(GrammarSpec("choice", CHOICES))
    start = llguidance_row(grammar.matcher(), grammar.vocab_size)
    moved, still = grammar.matcher(), grammar.matcher()
    assert moved.consume_tokens(tokenizer.encode("may").ids)
    assert not torch.equal(llguidance_row(moved, grammar.vocab_size), start)
    assert torch.equal(llguidance_row(still, grammar.vocab_size), start)
    assert torch.equal(llguidance_row(grammar.matcher(), grammar.vocab_size), start)  # the template never moves


# --- HF's processor masks as the engine does --------------------------------------------------------------

def test_hf_processor_masks_like_a_walked_matcher(grammar_compiler):
    grammar = grammar_compiler.compile(GrammarSpec("json_schema", SCHEMA))
    vocab, prompt = grammar.vocab_size, [9707, 11, 1879, 0, 42]
    processor = GrammarLogitsProcessor(grammar, len(prompt))
    reference, gen = grammar.matcher(), torch.Generator().manual_seed(3)
    ids, steps = list(prompt), 0
    while True:
        scores = torch.randn(1, vocab, generator=gen)
        raw = scores.clone()
        out = processor(torch.tensor([ids]), scores)
        allowed = llguidance_row(reference, vocab)
        assert torch.equal(out[0] == -float("inf"), ~allowed)
        assert torch.equal(out[0][allowed], raw[0][allowed]) and torch.equal(scores, raw)  # its input untouched
        token = int(out[0].argmax())  # greedy, as generate would pick
        steps += 1
        if token in EOS_IDS:
            break
        assert reference.consume_token(token)
        ids.append(token)
    assert steps > 5 and allowed.sum() == len(EOS_IDS)  # at the end only EOS is left


def test_llguidance_refusing_its_arguments_is_a_course_error(compiler, monkeypatch):
    """grammar_from_* documents ValueError for arguments it cannot take: the request's fault, so a CourseError
    (the server's 400), never an exception that would reach the client as a 500."""
    def refuse(*args, **kwargs):
        raise ValueError("not a valid JSON object\nsecond line")

    monkeypatch.setattr(grammar_module.llguidance.LLMatcher, "grammar_from_json_schema", refuse)
    with pytest.raises(CourseError, match=r"^json_schema cannot be compiled: not a valid JSON object$"):
        compiler.compile(GrammarSpec("json_schema", {"type": "object", "title": "refused"}))

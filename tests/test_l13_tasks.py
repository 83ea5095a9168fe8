"""L13's build-track tests for the ECMA-262 rewrite, the grammar text of each kind, and the matcher's life in a step
(scripts/course.py check L13); the mask layout's, the mask's and the compile cache's are in test_l13_mask.py, the
engine's in test_l13_engine.py and test_l13_interactions.py."""
import llguidance
import pytest
import regex  # transformers' own dependency: Python's re with nested classes (V1), as Rust's regex crate has them
import torch

from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l13_structured import mask
from lessons.l13_structured.ecma import ecma_regex
from lessons.l13_structured.engine import advance, matcher_of
from lessons.l13_structured.grammar import GrammarSpec, grammar_text
from lessons.l13_structured.sampling import ConstrainedSampling
from shared.errors import CourseError
from test_l13_standards import ECMA_CASES


@pytest.mark.task("L13.3")
def test_ecma_regex_spells_out_what_ecma_262_means():
    """Each rewritten pattern, read by the `regex` module (whose \\d, \\w, \\s and . differ from ECMA-262's as
    Rust's do, so only explicit classes get these right), matches exactly what ECMA-262 matches."""
    for pattern, text, want in ECMA_CASES:
        rewritten = ecma_regex(pattern)
        got = regex.fullmatch(rewritten, text, flags=regex.V1) is not None
        assert got == want, (f"/{pattern}/ on {text!r}: ECMA-262 says {want}, the rewrite {rewritten!r} says {got}")
    for pattern, want in ((r"\d{3}", "[0-9]{3}"), (r"[\d.]", "[0-9.]"), (r"\D", "[^0-9]"), (r"[.]", "[.]"),
                          (r"a\.b", r"a\.b"), (r"\u00e9", r"\u00e9")):
        assert ecma_regex(pattern) == want, f"ecma_regex({pattern!r}) should be {want!r}, got {ecma_regex(pattern)!r}"


ZIP = {"type": "object", "properties": {"zip": {"type": "string", "pattern": r"^\d{3}$"}}, "required": ["zip"],
       "additionalProperties": False}
KINDS = [  # (spec, an output it accepts, one it refuses, why)
    (GrammarSpec("json_schema", ZIP), '{"zip":"123"}', '{"zip": "123"}',
     "JSON compiles without free whitespace (whitespace_flexible False): a weak model loops on spaces"),
    (GrammarSpec("json_schema", ZIP), '{"zip":"123"}', '{"zip":"١٢٣"}', "the pattern is read as ECMA-262's \\d"),
    (GrammarSpec("json_object"), '{"k":[1,{"z":null}]}', "[1]", "json_object is any object"),
    (GrammarSpec("regex", r"\d{2}-[a-z]+"), "12-ab", "12-", "the whole regex must match"),
    (GrammarSpec("regex", r"\d{2}-[a-z]+"), "12-ab", "١٢-ab", "\\d is ECMA-262's [0-9]"),
    (GrammarSpec("choice", ["yes", "no", "maybe not"]), "maybe not", "maybe", "one of the choices, whole"),
    (GrammarSpec("grammar", 'start: "a" ("b" | "c")+'), "abcb", "ad", "Lark"),
    (GrammarSpec("grammar", 'root ::= "a" [bc]+'), "abcb", "ad", "GBNF"),
]


@pytest.mark.task("L13.4")
def test_grammar_text_of_each_kind_accepts_its_outputs_only(grammar_compiler, tokenizer):
    def accepts(text: str, grammar: str) -> bool:
        ids = tokenizer.encode(text).ids
        matcher = llguidance.LLMatcher(grammar_compiler.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), f"llguidance cannot read the grammar text: {matcher.get_error()}"
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    for spec, good, bad, why in KINDS:
        text = grammar_text(spec)
        assert isinstance(text, str), f"grammar_text({spec.kind}) should be llguidance's grammar text, got {text!r}"
        assert accepts(good, text), f"{spec.kind} {spec.source!r} should accept {good!r} ({why})"
        assert not accepts(bad, text), f"{spec.kind} {spec.source!r} should refuse {bad!r} ({why})"
    with pytest.raises(CourseError, match="unknown grammar kind"):
        grammar_text(GrammarSpec("xml", "<a/>"))


def mask_of(matcher, vocab_size: int) -> torch.Tensor:
    bitmask = mask.allocate(1, vocab_size)
    mask.fill(matcher, bitmask, 0)
    return bitmask[0]


@pytest.mark.task("L13.6")
def test_a_matcher_per_output_follows_kept_tokens_and_rolls_back_rejected_drafts(grammar_compiler, tokenizer):
    grammar = grammar_compiler.compile(GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,4}"))
    tok = {c: tokenizer.token_to_id(c) for c in "0123456789-abx"}

    def reference(text: str):
        m = grammar.matcher()
        assert m.consume_tokens([tok[c] for c in text]), f"the premise: {text!r} is a prefix the grammar allows"
        return m

    def same_state(m, text: str, what: str) -> None:
        assert not m.is_error(), f"{what}: the matcher is in error ({m.get_error()})"
        assert torch.equal(mask_of(m, grammar.vocab_size), mask_of(reference(text), grammar.vocab_size)), (
            f"{what}: the matcher's mask is not the one after {text!r}")

    seq = SharedSequence([1, 2, 3], 16, sampling=ConstrainedSampling(grammar=grammar))
    m = matcher_of(seq)
    assert seq.extra.get("matcher") is m and matcher_of(seq) is m, "one matcher per output, kept in seq.extra"
    same_state(m, "", "a new output's matcher")

    seq = SharedSequence([1, 2, 3], 16, output_ids=[tok["1"], tok["2"]], sampling=ConstrainedSampling(grammar=grammar))
    same_state(matcher_of(seq), "12", "a matcher made for an output that has tokens (rebuilt after it was lost)")

    # After "1": the step's mask_rows took in drafts "2", "3" (a draft "4" was forbidden); the target kept "2"
    # and then chose "5": the "3" is rolled back before "5" goes in.
    m = reference("123")
    advance(m, [tok["2"], tok["5"]], drafts_taken=2)
    same_state(m, "125", "drafts 2, 3 taken, 2 accepted, then the target's 5")
    m = reference("123")
    advance(m, [tok["2"], tok["3"], tok["-"]], drafts_taken=2)
    same_state(m, "123-", "drafts 2, 3 taken and accepted, then the bonus -")
    m = reference("1")
    advance(m, [tok["7"]], drafts_taken=0)
    same_state(m, "17", "a plain decode's token")
    m = reference("12")
    advance(m, [tok["9"]], drafts_taken=1)
    same_state(m, "19", "a draft taken and rejected at once")

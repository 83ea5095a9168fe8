"""scripts/l13_smoke.py: one --json run (one prompt, so all three grammars run on it):
every greedy output equals HF's with the grammar's processor, the server's, and validates; the sampled ones
validate and repeat; the parity matrix reads it as a PASS. Bad values are one line and exit 2; HF run without
the grammar (its processor a no-op) is a mismatch, exit 1. HF's side of the parity rule keeps the masked scores.
CI's smoke loop makes the no-argument run (its exit status checked there); this file makes two short runs in its
own process (one server started by each) and cheap checks."""
from __future__ import annotations

import json
import math
import re
import sys
from types import SimpleNamespace

import jsonschema
import pytest

from lessons.l13_structured import mask
from lessons.l13_structured.hf_processor import GrammarLogitsProcessor, GrammarOracle
from shared.generation import StopRule
from test_bad_input import ROOT, run_script

sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "checks"))
import l13_smoke as smoke  # noqa: E402
import parity_matrix as pm  # noqa: E402

SCRIPT = "l13_smoke.py"
PROMPT = "Tell me about Rome:"


def run_smoke(argv: list[str], monkeypatch, capsys, grammar_compiler) -> tuple[int, str, str]:
    """The smoke's main in this process (no second interpreter, torch and transformers already imported), with the
    session's grammar compiler (llguidance reads the tokenizer once per session)."""
    monkeypatch.setattr(smoke, "GrammarCompiler", lambda *args: grammar_compiler)
    with pytest.raises(SystemExit) as exit_status:
        smoke.main(argv)
    out, err = capsys.readouterr()
    return exit_status.value.code, out, err


@pytest.mark.slow  # the engine, HF with the grammar and a live server, every grammar
def test_one_prompt_runs_every_grammar_equal_to_hf_and_the_server_and_valid(monkeypatch, capsys, grammar_compiler):
    """A --json run with one prompt: CI's smoke loop has just made the no-argument run (exit 0 checked there)."""
    code, out, err = run_smoke(["--json", "--prompt", PROMPT], monkeypatch, capsys, grammar_compiler)
    assert code == 0, out[-3000:] + err[-3000:]
    report = json.loads(out)  # the whole of stdout is one JSON object
    assert report["match"] is True and report["ok"] is True and report["extra_check"]["ok"] is True
    assert report["max_new_tokens"] == smoke.DEFAULT_MAX_NEW_TOKENS and report["dtype"] == "float32"
    entries = report["prompts"]
    assert [e["grammar"] for e in entries] == ["json_schema", "regex", "choice"]
    for e in entries:
        assert e["prompt"] == PROMPT and e["L13"] == e["hf"] == e["server"] and e["hf"], e
        assert e["L13_verdict"]["status"] == e["server_verdict"]["status"] == "match"
        assert e["L13_verdict"]["judged"] == len(e["L13"]) and e["finish"] == "stop" and e["valid"]
        assert e["server_text"] == e["text"]
        sampled = e["sampled"]
        assert sampled["tokens"] == sampled["again"] == sampled["server"] and sampled["valid"]
    json_entry, regex_entry, choice_entry = entries
    jsonschema.validate(json.loads(json_entry["text"]), smoke.SCHEMA)
    jsonschema.validate(json.loads(json_entry["sampled"]["text"]), smoke.SCHEMA)
    assert re.fullmatch(smoke.REGEX, regex_entry["text"]) and re.fullmatch(smoke.REGEX, regex_entry["sampled"]["text"])
    assert choice_entry["text"] in smoke.CHOICES and choice_entry["sampled"]["text"] in smoke.CHOICES
    assert [e["sampled"]["seed"] for e in entries] == [smoke.FIRST_SEED + i for i in range(3)]
    assert report["chat"]["finish"] == "stop"
    jsonschema.validate(json.loads(report["chat"]["text"]), smoke.SCHEMA)
    outcome = pm.classify(code, out, err)
    tokens = sum(len(e["L13"]) + len(e["server"]) for e in entries)
    assert outcome.status == "PASS" and outcome.judged == outcome.tokens == tokens, outcome


def test_prompts_cycle_so_every_grammar_and_every_prompt_runs():
    def kinds(n: int) -> list[tuple[str, str]]:
        setup = SimpleNamespace(prompts=[f"p{i}" for i in range(n)], prompt_ids=[[i + 1] for i in range(n)])
        return [(r.prompt, r.spec.kind) for r in smoke.requests_for(setup)]

    assert kinds(1) == [("p0", "json_schema"), ("p0", "regex"), ("p0", "choice")]
    assert kinds(2) == [("p0", "json_schema"), ("p1", "regex"), ("p0", "choice")]
    assert kinds(4) == [("p0", "json_schema"), ("p1", "regex"), ("p2", "choice"), ("p3", "json_schema")]


@pytest.mark.parametrize("spec, text, problem", [
    (smoke.GRAMMARS[0], '{"title":"x"', "does not parse as JSON"),
    (smoke.GRAMMARS[0], '{"title":"x","year":1800,"genre":"fiction","author":{"name":"a","born":1900},"tags":[]}',
     "does not validate against the schema: 1800 is less than the minimum of 1900"),
    (smoke.GRAMMARS[1], "AB-12", "does not match"),
    (smoke.GRAMMARS[2], "yes!", "is not one of"),
])
def test_validation_names_what_is_wrong(spec, text, problem):
    assert smoke.validate(spec, text).startswith(problem)


def test_valid_outputs_pass_validation():
    good = '{"title":"","year":1900,"genre":"poetry","author":{"name":"","born":1800},"tags":["new","short"]}'
    assert [smoke.validate(s, t) for s, t in zip(smoke.GRAMMARS, [good, "AB-1234", "maybe"])] == [None] * 3


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "0"], "error: max-new-tokens must be at least 1, got 0"),
    (["--block-size", "0"], "error: block-size must be at least 1, got 0"),
    (["--model", "/nonexistent/l13"], "error: model directory /nonexistent/l13 does not exist"),
    (["--num-blocks", "2"], "error: request 0: prompt (6 tokens) + max-new-tokens (64) needs 5 blocks"),
])
def test_bad_values_are_one_line_exit_2(argv, message, capsys):
    code, out, err = run_script(SCRIPT, argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(message), lines


def test_hf_without_the_grammar_is_a_mismatch_exit_1(monkeypatch, capsys, grammar_compiler):
    """The planted bug: HF's processor masks nothing, so HF's greedy tokens leave the grammar at once."""
    monkeypatch.setattr(GrammarLogitsProcessor, "__call__", lambda self, input_ids, scores: scores)
    code, out, err = run_smoke(["--prompt", PROMPT, "--max-new-tokens", "4"], monkeypatch, capsys, grammar_compiler)
    out = " ".join(out.split())
    assert code == 1, out + err
    assert "L13 vs HF: MISMATCH first divergence at position 0:" in out
    assert "server vs HF: MISMATCH first divergence at position 0:" in out  # the server's tokens are judged too
    assert "FAIL: greedy: request 0, 1, 2 diverged from HF generate" in out


def test_hf_side_keeps_the_masked_scores_and_the_oracle_masks_too(hf, tokenizer, grammar_compiler):
    """The parity rule's margins come from the scores generate picked from (masked), not its raw logits; and HF
    scoring our tokens after a tie picks, teacher-forced, what it generated under the mask."""
    stop = StopRule(smoke.DEFAULT_MAX_NEW_TOKENS, grammar_compiler.eos_ids)
    for spec in smoke.GRAMMARS:
        grammar = grammar_compiler.compile(spec)
        ids = tokenizer.encode(PROMPT).ids
        oracle = GrammarOracle(hf.ref, grammar, len(ids))
        out = oracle.generate(ids, stop)
        assert out.tokens == hf.ref.generate(ids, stop, [GrammarLogitsProcessor(grammar, len(ids))]).tokens
        allowed = mask.allocate(1, grammar.vocab_size)
        mask.fill(grammar.matcher(), allowed, 0)
        first = [t for t, logit in out.near[0].items() if math.isfinite(logit)]
        assert first and all(mask.is_allowed(allowed[0], t) for t in first), spec.kind
        assert oracle.score(ids + out.tokens, len(ids)).tokens[:len(out.tokens)] == out.tokens
        assert oracle.fp32_argmax(ids) == out.tokens[0]

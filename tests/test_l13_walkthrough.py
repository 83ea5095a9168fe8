"""scripts/l13_walkthrough.py: the wall (no valid JSON without a grammar, all valid with one) and the walked steps.

In-process with the session's model and grammar compiler, and a handful of completions: the doc shows the
full 200 (a measured region), this checks the script still says what the doc reads from it."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "l13_walkthrough.py"


@pytest.fixture(scope="module")
def walkthrough():
    spec = importlib.util.spec_from_file_location("l13_walkthrough_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wall_and_three_steps(walkthrough, tiny_model, tokenizer, grammar_compiler, capsys):
    assert walkthrough.run(4, 0, 3, loaded=(tiny_model, tokenizer, grammar_compiler))
    out = capsys.readouterr().out
    # The wall: nothing parses without the grammar; everything validates with it, each ended by EOS.
    assert re.search(r"without a grammar +parse +0 of 4 +validate +0 of 4", out), out
    assert re.search(r"with the schema +parse +4 of 4 +validate +4 of 4 .* end with EOS +4", out), out
    # A JSON object's first token is forced ('{"'), whatever the model prefers; three steps shown, no more.
    assert "step 1: the matcher allows 1 of 151,936 tokens: '{\"'" in out
    assert "step 3: " in out and "step 4: the matcher" not in out
    assert out.count("(the same)") == 3 and "DIFFERENT" not in out  # L4's sampler on the masked row = the engine
    assert "bitmask int32 [1, 4748]" in out and "18,992 B a row" in out
    assert "the matcher allows 2 tokens, [151643, 151645] (EOS)" in out  # the grammar's end: only EOS
    assert "valid; the matcher is_accepting True, is_stopped True" in out
    assert "conditions · commit" in out


def test_bad_options_are_one_line(walkthrough, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["l13_walkthrough.py", "--n", "0"])
    with pytest.raises(SystemExit) as exit_:
        walkthrough.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --n 0: choose 1..1000"

"""The L4 / L5 smoke scripts keep the contract: bad sampling or scheduling input is one line and exit 2."""
import pytest

from test_bad_input import run_script


@pytest.mark.parametrize("argv, words", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--top-k", "-2"], "top-k must be >= 0"),
    (["--max-running", "0"], "max-running must be at least 1"),
    (["--max-new-tokens", "0"], "max-new-tokens must be at least 1"),
    (["--num-blocks", "1", "--block-size", "4"], "the whole pool has 1"),
])
def test_l4_smoke_rejects(argv, words, capsys):
    code, out, err = run_script("l4_smoke.py", argv, capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert words in err


@pytest.mark.parametrize("argv, words", [
    (["--policy", "lru"], "invalid choice"),
    (["--host-blocks", "0", "--policy", "swap"], "host-blocks must be at least 1"),
])
def test_l5_smoke_rejects(argv, words, capsys):
    code, out, err = run_script("l5_smoke.py", argv, capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert words in err

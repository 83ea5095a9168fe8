"""scripts/l11_smoke.py end to end: the default workload drafts and matches HF and L9 with no leak; the target
drafting for itself saves steps; another draft checkpoint loads; --tp 2 (a process of its own, rank 1 spawned
from it); bad K and bad draft models are one line and exit 2."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import save_file

from shared.tiny_qwen3 import TINY_CONFIG, tiny_weights
from test_bad_input import ROOT, run_script

SCRIPT = "l11_smoke.py"
# Two prompts for the runs that need not be the default workload: the self-repeating one and a short one.
REPEAT = " the horn the cat the iron the road the child the glass the coat the"
FEW = ["--prompt", REPEAT, "--prompt", "Hello, world!"]


@pytest.fixture(autouse=True)
def scripts_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as when the smoke runs: it imports l8_smoke and l10_smoke


def counts(message: str) -> dict[str, int]:
    """The numbers of the report line: drafted, accepted, steps with and without speculation, blocks free."""
    found = {
        "drafted": r"(\d+) drafted", "accepted": r"(\d+) accepted", "steps": r"(\d+) target forwards",
        "plain_steps": r"(\d+) without", "saved": r"(\d+) saved", "free": r"(\d+) of \d+ usable blocks",
        "usable": r"\d+ of (\d+) usable blocks",
    }
    return {name: int(re.search(pattern, message).group(1)) for name, pattern in found.items()}


def write_checkpoint(folder: Path, **changes) -> Path:
    """The embedded model's shape with some fields changed, its own seeded weights, no tokenizer (a draft needs none)."""
    cfg = {**TINY_CONFIG, **changes}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tiny_weights(cfg, seed=7), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_default_workload_drafts_and_matches_hf_and_l9(capsys):
    """The default workload (as JSON, 8 tokens each; .ci/run makes the no-argument, 20-token run): every request
    equals HF's and L9's, the n-gram drafter proposed drafts, nothing leaked."""
    code, out, err = run_script(SCRIPT, ["--json", "--max-new-tokens", "8"], capsys)
    result = json.loads(out)  # the whole of stdout is one JSON object
    assert code == 0 and result["lesson"] == "L11" and result["match"], err
    assert result["extra_check"]["ok"], result["extra_check"]
    assert len(result["prompts"]) == 8 and result["max_new_tokens"] == 8
    for q in result["prompts"]:
        assert q["L11"] == q["L9"] == q["hf"] and len(q["hf"]) > 0
        assert q["L11_verdict"]["status"] == q["L9_verdict"]["status"] == "match"
        assert q["L11_verdict"]["judged"] == len(q["hf"])
    message = result["extra_check"]["message"]
    assert "K = 4, n-gram drafter" in message and "(LEAK)" not in message
    n = counts(message)
    assert n["drafted"] > 0 and n["free"] == n["usable"]


def test_target_drafting_for_itself_accepts_every_draft_and_saves_steps(capsys):
    code, out, err = run_script(SCRIPT, ["--drafter", "draft", "--max-new-tokens", "12", *FEW], capsys)
    assert code == 0, err
    flat = " ".join(out.split())
    assert "L11 vs HF: identical" in flat and "L9 vs HF: identical" in flat
    assert "the target itself drafting for itself" in flat
    line = flat[flat.index("PASS: L11, K = 4"):]
    n = counts(line)
    # Greedy drafts of the target itself are its own choices: all kept, so each verify row makes up to K + 1 tokens.
    assert n["drafted"] > 0 and n["accepted"] == n["drafted"]
    assert n["saved"] == n["plain_steps"] - n["steps"] > 0 and n["free"] == n["usable"]
    assert re.search(r"; \d+ draft-model forwards", line)


def test_another_checkpoint_drafts_and_k_is_honoured(tmp_path, capsys):
    """A one-layer draft model with other weights: its drafts are mostly rejected, the output is still exact."""
    draft = write_checkpoint(tmp_path / "draft", num_hidden_layers=1)
    code, out, err = run_script(SCRIPT, ["--drafter", "draft", "--draft-model", str(draft), "--json",
                                         "--num-speculative-tokens", "2", "--max-new-tokens", "6", *FEW], capsys)
    result = json.loads(out)
    assert code == 0 and result["match"] and result["extra_check"]["ok"], err
    message = result["extra_check"]["message"]
    assert f"K = 2, draft model {draft}" in message
    n = counts(message)
    assert 0 < n["drafted"] <= 2 * 5 * 2 and n["free"] == n["usable"]  # at most K per decode step per request


def test_k_zero_is_l9(capsys):
    code, out, err = run_script(SCRIPT, ["--num-speculative-tokens", "0", "--max-new-tokens", "4", "--json", *FEW],
                                capsys)
    result = json.loads(out)
    assert code == 0 and result["extra_check"]["ok"], err
    n = counts(result["extra_check"]["message"])
    assert n["drafted"] == 0 and n["saved"] == 0 and n["steps"] == n["plain_steps"]


@pytest.mark.parametrize("argv,message", [
    (["--num-speculative-tokens", "-1"], "error: argument --num-speculative-tokens: -1 is below 0"),
    (["--num-speculative-tokens", "two"], "error: argument --num-speculative-tokens: 'two' is not a whole number"),
    (["--num-speculative-tokens", "2.5"], "error: argument --num-speculative-tokens: '2.5' is not a whole number"),
    (["--drafter", "draft", "--draft-model", "/no/such/draft"],
     "error: argument --draft-model: directory /no/such/draft does not exist"),
    (["--draft-model", "{tmp}"], "error: --draft-model and --draft-layers need --drafter draft"),
    (["--draft-layers", "2"], "error: --draft-model and --draft-layers need --drafter draft"),
    (["--drafter", "draft", "--draft-layers", "2", "--draft-model", "{tmp}"],
     "error: --draft-model and --draft-layers are two draft models: give one"),
    (["--drafter", "draft", "--draft-layers", "4"],
     "error: --draft-layers must be 1 to 3 (the target has 4 layers), got 4"),
    (["--drafter", "draft", "--draft-model", "{tmp}"], "error: no config.json in model directory {tmp}"),
    (["--drafter", "draft", "--draft-model", "{vocab}"],
     "error: the draft model's vocabulary (1000) is not the target's (151936): it must use the same tokenizer"),
])
def test_bad_values_are_one_line_exit_2(argv, message, tmp_path, capsys):
    vocab = write_checkpoint(tmp_path / "vocab", vocab_size=1000) if "{vocab}" in argv else None
    fill = {"{tmp}": str(tmp_path), "{vocab}": str(vocab)}
    code, out, err = run_script(SCRIPT, [fill.get(a, a) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(message.replace("{tmp}", str(tmp_path))), lines


def test_an_early_exit_draft_keeps_parity(capsys):
    """The target's first two layers draft: HF's and L9's tokens still, and the report names the draft."""
    code, out, err = run_script(SCRIPT, ["--drafter", "draft", "--draft-layers", "2", "--max-new-tokens", "8",
                                         "--json", *FEW], capsys)
    result = json.loads(out)
    assert code == 0 and result["match"] and result["extra_check"]["ok"], err
    assert "early-exit draft: the target's first 2 layers" in result["extra_check"]["message"]
    assert counts(result["extra_check"]["message"])["drafted"] > 0


@pytest.mark.slow  # rank 1 spawned, HF and L9 beside it
def test_tp2_speculates_on_the_split_model():
    """Its own process (rank 1 is spawned from it): the target drafting for itself on 2 ranks matches HF and L9."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, f"scripts/{SCRIPT}", "--tp", "2", "--drafter", "draft", "--json",
                        "--max-new-tokens", "8", *FEW], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout)
    assert result["match"] and result["extra_check"]["ok"], result["extra_check"]
    assert all(q["L11"] == q["L9"] == q["hf"] for q in result["prompts"])
    message = result["extra_check"]["message"]
    assert message.startswith("L11 on 2 ranks, K = 4") and "(LEAK)" not in message
    n = counts(message)
    assert n["drafted"] > 0 and n["accepted"] == n["drafted"] and n["saved"] > 0

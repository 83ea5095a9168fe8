"""The smoke-script contract: --json is one object; a planted KV bug gives exit 1 and names the divergence."""
import json

import pytest

from lessons.l2_token_flat.kv_pool import KvPool
from test_bad_input import run_script


@pytest.mark.parametrize("script,names", [("l1_smoke.py", ["L1"]), ("l2_smoke.py", ["L2", "L1"])])
def test_json_is_one_object_with_matching_tokens(script, names, capsys):
    code, out, err = run_script(script, ["--json"], capsys)
    assert code == 0, err
    report = json.loads(out)  # the whole of stdout is one JSON object
    assert report["match"] is True and report["max_new_tokens"] == 20
    (entry,) = report["prompts"]
    assert len(entry["hf"]) == 20
    for name in names:
        assert entry[name] == entry["hf"]
        assert entry[f"{name}_verdict"]["status"] == "match"


def test_planted_kv_bug_exits_1_and_reports_the_divergence(monkeypatch, capsys):
    real_attend = KvPool.attend

    def stale_history(self, layer, q, k, v, meta):  # forget the oldest cached token during decode
        if not meta.is_prefill:
            meta = type(meta)(meta.positions, meta.slot_mapping, meta.kv_indices[1:], meta.is_prefill)
        return real_attend(self, layer, q, k, v, meta)

    monkeypatch.setattr(KvPool, "attend", stale_history)
    code, out, err = run_script("l2_smoke.py", ["--block-size", "4"], capsys)
    assert code == 1, err
    assert "L2 vs HF: MISMATCH first divergence at position 1:" in " ".join(out.split())
    assert "L1 vs HF: identical" in out
    assert "FAIL" in out
    code, out, _ = run_script("l2_smoke.py", ["--json"], capsys)
    verdict = json.loads(out)["prompts"][0]["L2_verdict"]
    assert code == 1 and verdict["status"] == "mismatch" and verdict["position"] == 1 and verdict["margin"] > 0


def test_result_lines_survive_a_pipe_and_a_narrow_terminal():
    """Rich wraps at 80 columns (or $COLUMNS) when piped; the lines a learner greps for must stay whole."""
    import os
    import subprocess
    import sys

    from test_bad_input import ROOT

    env = os.environ | {"COLUMNS": "20"}
    r = subprocess.run([sys.executable, "scripts/l2_smoke.py", "--max-new-tokens", "3", "--prompt", "a b c d e f g h"],
                       cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "L2 vs HF: identical" in lines and "PASS: every prompt matches HF" in lines


def test_help_states_each_smokes_own_pool_defaults(capsys):
    code, out, _ = run_script("l5_smoke.py", ["--help"], capsys)
    assert code == 0 and "tokens per KV block (default: 4)" in " ".join(out.split())
    code, out, _ = run_script("l2_smoke.py", ["--help"], capsys)
    assert code == 0 and "(default: 16)" in out and "4096 tokens' worth" in " ".join(out.split())

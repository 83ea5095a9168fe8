"""scripts/l6_smoke.py end to end: the default run serves tokens from the cache; --n checks forks."""
import json

from test_bad_input import run_script


def test_default_run_matches_and_hits_the_cache(capsys):
    code, out, err = run_script("l6_smoke.py", ["--json", "--max-new-tokens", "6"], capsys)
    result = json.loads(out)
    assert code == 0 and result["match"], err
    assert result["extra_check"]["ok"] and "116 served from the cache" in result["extra_check"]["message"]
    assert all(p["L6"] == p["hf"] == p["L5"] for p in result["prompts"])


def test_parallel_sampling_children_equal_their_seeds_alone(capsys):
    code, out, err = run_script("l6_smoke.py", ["--n", "2", "--temperature", "0.9", "--seed", "3",
                                                "--max-new-tokens", "5", "--prompt", "The capital of France is"], capsys)
    assert code == 0, out + err
    assert "all 2 children equal their seed alone; 1 copy-on-write" in out

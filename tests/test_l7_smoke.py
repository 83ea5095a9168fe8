"""scripts/l7_smoke.py end to end: the default workload crosses captured sizes and matches HF and L6."""
import json

from test_bad_input import run_script


def test_default_run_replays_several_sizes_and_matches(capsys):
    code, out, err = run_script("l7_smoke.py", ["--json", "--max-new-tokens", "8"], capsys)
    result = json.loads(out)
    assert code == 0 and result["match"] and result["extra_check"]["ok"], err
    assert all(p["L7"] == p["hf"] == p["L6"] for p in result["prompts"])
    message = result["extra_check"]["message"]
    assert "(2: " in message and "4: " in message and "8: " in message and "each captured once" in message


def test_bad_capture_sizes_are_one_line_exit_2(capsys):
    code, out, err = run_script("l7_smoke.py", ["--capture-sizes", "1,x"], capsys)
    assert code == 2 and err.strip() == "error: --capture-sizes '1,x': use comma-separated integers, e.g. 1,2,4,8"

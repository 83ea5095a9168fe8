"""scripts/lesson_diff.py works for every adjacent pair of lessons that exists, and for lessons still to come:
every lesson declares ROLES that resolve, and each pair prints a real diff for every role it names."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import lesson_diff  # noqa: E402

FOLDERS = lesson_diff.lessons()


def test_every_lesson_folder_is_found():
    assert [f.name[:3] for f in FOLDERS[:5]] == ["l1_", "l2_", "l3_", "l4_", "l5_"]


@pytest.mark.parametrize("new", range(1, len(FOLDERS)), ids=lambda i: f"L{i}-L{i + 1}")
def test_adjacent_pair_diffs_every_role(new):
    text = lesson_diff.diff(new - 1, new, FOLDERS)
    for role, where in lesson_diff.roles(FOLDERS[new]).items():
        path, lines = lesson_diff.source(FOLDERS[new], where)
        assert f"# {role}" in text and path in text, (role, where)
        assert lines[0].lstrip().startswith("def "), f"{where} does not start at a def line"
    changed = [line for line in text.splitlines() if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
    assert changed, "the newer lesson's roles are all identical to the older ones: nothing to teach"


def test_a_role_missing_from_the_newer_lesson_is_listed_as_inherited():
    text = lesson_diff.diff(3, 4, FOLDERS)  # L5 keeps L3's kv seam and L4's engine loop
    assert "imported from earlier lessons: kv seam" in text and "engine loop" in text.splitlines()[-1]


@pytest.mark.parametrize("argv,words", [(["L3", "L99"], "no lesson folder for 'L99'"), (["L4", "L2"], "not earlier"),
                                       (["L1"], "name two lessons")])
def test_bad_arguments_are_one_line_exit_2(argv, words):
    r = subprocess.run([sys.executable, "scripts/lesson_diff.py", *argv], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr

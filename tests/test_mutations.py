"""Every planted bug of scripts/checks/mutations.py still finds its snippet exactly once.

The mutation check (scripts/checks/mutation_check.py) takes minutes and runs by hand; a snippet that no longer
matches the code it plants into (the code was rewritten) makes it report an error instead of a bug caught, and
nothing else would notice. This reads the files only: nothing is planted.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "checks"))
from mutations import MUTATIONS  # noqa: E402


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.id)
def test_every_snippet_is_found_exactly_once(mutation):
    for file, old, _ in mutation.edits():
        path = ROOT / file
        assert path.is_file(), f"{mutation.id}: {file} does not exist"
        found = path.read_text().count(old)
        assert found == 1, f"{mutation.id}: its snippet is found {found} times in {file}: {old!r}"

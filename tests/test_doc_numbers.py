"""Numbers in the docs' prose are produced or checked by code.

Output blocks (tests/test_doc_claims.py) check what a command prints in full. Prose and tables quote
numbers too: token IDs of a worked example, what a planted bug prints, a sizing figure. Those go in a
numbers region:

    <!-- numbers: $ python scripts/l1_smoke.py -->  ...prose or a table...  <!-- /numbers -->
    <!-- numbers: mutation l1-rows-short $ python scripts/l1_smoke.py -->  ...  <!-- /numbers -->

The test runs the command (on the embedded model, CPU, fp32, as output blocks run; with `mutation ID`,
in a scratch copy of the repository with that planted bug of scripts/checks/mutations.py applied) and requires
every number in the region (`4,096` and `4096` alike) to appear among the numbers it printed. Changing a
digit of a token ID or a figure then fails, and so does a command that stops printing it.

And the class of the defect, not only its instances: a sizing figure (a number with a unit of bytes or
FLOP, or a count of kernel launches) and a token-ID-like number (four or more digits, no thousands
separator) in a doc's prose must sit in an output block, a numbers region, or a quote of code.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest
from test_doc_claims import doc_run_env, run_doc_command

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
REGION = re.compile(r"<!-- numbers: (?:mutation (\S+) )?\$ (.+?) -->(.*?)<!-- /numbers -->", re.S)
OPEN = re.compile(r"<!-- numbers:")
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?!\w)")
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK_TARGET = re.compile(r"\]\([^)]*\)")
# Measured regions too: their numbers are what a named command printed, under a conditions line that
# tests/test_doc_measured.py checks (a commit hash, a load, a p99 of 1217 ms are not token IDs).
CHECKED = re.compile(r"^<!-- (?:output|quote)[^\n]*\n```.*?^```[ \t]*$|<!-- numbers: .*?<!-- /numbers -->|^<!-- measured: .*?^<!-- /measured -->", re.M | re.S)
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
# A figure with a sizing unit (bytes, FLOP, launches), and a bare number of four or more digits (a token ID).
SIZING = re.compile(r"(?<![\w.])\d[\d,.]*(?:\sB|\s?(?:KiB|MiB|GiB|TiB|KB|MB|GB|TB|TFLOP|GFLOP|PFLOP))(?![\w/])"
                    r"|(?<![\w.])\d[\d,]*\s(?:kernel\s)?launches")
TOKEN_ID = re.compile(r"(?<![\w.,#-])\d{4,6}(?![\w.,]\d|\w)")
# Bare four-digit numbers in prose that are sizes, not token IDs: powers of two (a pool of 4096 slots, a
# [1024, ...] shape) and round thousands.


def is_token_id_like(n: str) -> bool:
    value = int(n)
    return value & (value - 1) != 0 and value % 1000 != 0


def numbers(text: str) -> set[str]:
    return {n.rstrip(",").replace(",", "") for n in NUMBER.findall(text)}


def regions(doc: Path) -> list[tuple[str | None, str, str]]:
    return [(m.group(1), m.group(2), m.group(3)) for m in REGION.finditer(doc.read_text())]


ALL_REGIONS = [(doc, *r) for doc in DOCS for r in regions(doc)]


def _scratch_with(mutation_id: str, tmp: Path) -> Path:
    sys.path.insert(0, str(ROOT / "scripts" / "checks"))
    from mutations import MUTATIONS, plant  # noqa: E402

    mutation = next((m for m in MUTATIONS if m.id == mutation_id), None)
    assert mutation is not None, f"no mutation {mutation_id!r} in scripts/checks/mutations.py"
    copy = tmp / "repo"
    for part in ("lessons", "shared", "scripts", "tests"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    plant(mutation, copy)  # a stale snippet raises, naming it
    return copy


@lru_cache(maxsize=None)
def _printed(command: str, mutation: str | None) -> str:
    """What the command prints; each (command, mutation) runs once per session, however many regions quote it, and
    an unmutated command that an output block also shows shares that block's run (run_doc_command)."""
    if mutation is None:
        run = run_doc_command(command)
        return run.stdout + run.stderr
    cwd = _scratch_with(mutation, Path(tempfile.mkdtemp(prefix="mutant-")))
    words = shlex.split(command)
    assert words[0] == "python", f"a numbers region runs `python ...`, not {command!r}"
    env = {**doc_run_env(), "PYTHONPATH": str(cwd)}  # a mutant copy's code, not the installed tree's
    run = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    shutil.rmtree(cwd.parent, ignore_errors=True)
    return run.stdout + run.stderr


@pytest.mark.slow  # every command behind a number in the docs, run again (some with a bug planted)
@pytest.mark.parametrize("doc, mutation, command, body", ALL_REGIONS,
                         ids=[f"{d.relative_to(ROOT)}:{m or ''}:{c}" for d, m, c, _ in ALL_REGIONS])
def test_numbers_in_prose_are_printed_by_their_command(doc, mutation, command, body):
    text = LINK_TARGET.sub("]", COMMENT.sub("", body))
    wanted = numbers(text)
    printed = numbers(_printed(command, mutation))
    missing = sorted(wanted - printed, key=lambda n: (len(n), n))
    assert not missing, (f"{doc.relative_to(ROOT)}: `{command}`" + (f" with mutation {mutation}" if mutation else "")
                         + f" no longer prints {missing}, which the doc quotes")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_numbers_marker_opens_a_closed_region(doc):
    text = doc.read_text()
    assert len(OPEN.findall(text)) == len(REGION.findall(text)), (
        f"{doc.relative_to(ROOT)}: a `<!-- numbers: $ python ... -->` marker without its `<!-- /numbers -->`")


def unchecked_prose(doc: Path) -> str:
    """The doc without what code already checks (output blocks, quotes, numbers regions) or shows as code."""
    text = CHECKED.sub("", doc.read_text())
    return COMMENT.sub("", FENCE.sub("", text))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_sizing_figures_and_token_ids_are_checked(doc):
    prose = unchecked_prose(doc)
    sizing = sorted(set(SIZING.findall(prose)))
    token_ids = sorted(n for n in set(TOKEN_ID.findall(prose)) if is_token_id_like(n))
    assert not sizing and not token_ids, (
        f"{doc.relative_to(ROOT)}: figures no code checks (put them in an output block of scripts/sizing.py, or in a "
        f"`<!-- numbers: $ command -->` region): sizing {sizing}, token-ID-like {token_ids}")

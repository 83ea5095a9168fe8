"""Measured tables name their command and the conditions it printed, and go stale loudly.

A table of timings in a doc sits in a measured region:

    <!-- measured: $ OMP_NUM_THREADS=1 python scripts/benchmark/l8_bench.py --budgets 256 -->
    `conditions · commit 1a2b3c4 · cpu ... · threads 1 · device cpu · dtype float32 · backend cpp · load 0.10 -> 0.60`
    | engine | throughput | ...
    <!-- /measured -->

The conditions line is what the command printed (scripts/benchmark/harness.py). The test cannot check a
timing; it checks everything else a reader relies on: the command still parses (no option it names has gone),
the line's commit is in this repository's history and was clean, and the device, dtype, attention backend and
thread count the same command would use today equal the ones the table was measured with. When `auto` starts
picking another backend, or an option's default changes, the tables measured under the old one fail here
until they are rerun. And the class of the defect: a table of timings outside a measured region fails too.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import harness  # noqa: E402
from test_doc_claims import ENV_ASSIGNMENT  # noqa: E402

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
REGION = re.compile(r"^<!-- measured: \$ (.+?) -->\n(.*?)^<!-- /measured -->", re.S | re.M)
OPEN = re.compile(r"^<!-- measured:", re.M)  # at a line's start: prose may name the marker
CONDITIONS = re.compile(r"^`?(conditions · .+?)`?\s*$", re.M)
# Regions whose numbers another test checks against a command's output, and quoted output.
CHECKED = re.compile(r"<!-- numbers: .*?<!-- /numbers -->|^<!-- (?:output|quote)[^\n]*\n```.*?^```[ \t]*$", re.M | re.S)
# A cell holding a timing or a rate: "37.2 ms", "1.5 s", "1,204 tok/s", "114.7 GFLOP/s" (ratios alone are often
# counts, which test_doc_numbers checks).
TIMED = re.compile(r"\d\s?(?:ms|µs|us|s|tok/s|[GT]FLOP/s)(?![\w/])")
# A header naming a timing, a rate, or a share of a measured ceiling.
TIMED_HEADER = re.compile(r"(?<!\w)(?:ms|µs|seconds|tok/s|[GT]FLOP/s|TTFT|TPOT|ITL|throughput|roofline|clients|samples)(?!\w)|\(s\)")


def regions(doc: Path) -> list[tuple[str, str, int]]:
    text = doc.read_text()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in REGION.finditer(text)]


ALL = [(doc, *r) for doc in DOCS for r in regions(doc)]


def test_every_region_opened_is_closed_and_well_formed():
    for doc in DOCS:
        text = doc.read_text()
        assert len(OPEN.findall(text)) == len(REGION.findall(text)), f"{doc.name}: a malformed measured region"


def timing_tables(text: str) -> list[int]:
    """Line numbers of markdown tables with a timing in a cell, outside measured and checked regions."""
    for pattern in (REGION, CHECKED):
        text = pattern.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    found, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            body = "\n".join(lines[i + 2:j])  # below the header and its rule
            first_cells = " ".join(row.split("|")[1] for row in lines[i + 2:j] if row.count("|") > 1)
            if TIMED.search(body) or TIMED_HEADER.search(lines[i] + " " + first_cells):
                found.append(i + 1)
            i = j
        else:
            i += 1
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_timing_tables_sit_in_measured_regions(doc):
    lines = timing_tables(doc.read_text())
    assert not lines, (f"{doc.name}: tables of timings at lines {lines} name no command and conditions: put each in "
                       "a <!-- measured: $ command --> region with the conditions line the command printed")


def test_the_class_check_sees_a_bare_table():
    bare = "text\n\n| engine | throughput |\n| --- | --- |\n| L8 | 1,204 tok/s |\n"
    assert timing_tables(bare) == [3]
    assert timing_tables("<!-- measured: $ python x.py -->\n" + bare + "<!-- /measured -->\n") == []


@lru_cache(maxsize=None)
def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"measured_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a script's dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def split_command(command: str) -> tuple[dict[str, str], Path, list[str]]:
    words = shlex.split(command)
    env = {}
    while words and ENV_ASSIGNMENT.match(words[0]):  # the same rule output blocks' commands follow
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    assert len(words) >= 2 and words[0] == "python", f"a measured command is `python SCRIPT ...`: {command!r}"
    return env, ROOT / words[1], words[2:]


@lru_cache(maxsize=None)
def in_history(sha: str) -> bool | None:
    """Whether `sha` is HEAD or an ancestor of it; None where git cannot say (no git, a shallow clone)."""
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.strip() == "true"
        ok = subprocess.run(["git", "merge-base", "--is-ancestor", sha, "HEAD"], cwd=ROOT, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return True if ok.returncode == 0 else None if shallow else False


@pytest.mark.parametrize("doc, command, body, line", ALL, ids=[f"{d.name}:{n}" for d, _, _, n in ALL])
def test_measured_region_matches_what_its_command_would_run_today(doc, command, body, line):
    where = f"{doc.name}:{line}"
    env, script, argv = split_command(command)
    assert script.is_file(), f"{where}: {script.relative_to(ROOT)} does not exist"
    module = load_script(script)
    try:
        args = module.parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `{command}` no longer parses (see the error above)")
    lines = CONDITIONS.findall(body)
    assert lines, f"{where}: no conditions line (the one the command printed) in the region"
    for text in lines:
        measured = harness.parse_line(text)
        sha = measured.get("commit", "unknown")
        assert re.fullmatch(r"[0-9a-f]{7,40}", sha), f"{where}: measured on {sha!r}, not on a commit"
        assert in_history(sha) is not False, f"{where}: commit {sha} is not in this repository's history"
        plan = getattr(module, "planned", harness.planned)(args, env, measured.get("device", "cpu"))
        for key, value in plan.items():
            assert measured.get(key) == value, (
                f"{where}: the table was measured with {key} {measured.get(key)!r}, but `{command}` would use "
                f"{value!r} today: rerun it and paste what it prints")

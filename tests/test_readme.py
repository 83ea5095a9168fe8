"""README.md's first screen: one path, an install that is right on a laptop without a GPU, and how long it all takes.

A newcomer reads the README from the top, and .ci/run runs its blocks as written (the first ```bash block under
"## Quick start", then under "## The whole suite", later under "## A real model"). Held here:

- the first ```bash block is the quick start's, and it installs torch from PyTorch's CPU index before any other
  `pip install` (the course's own install pulls torch, which from PyPI on Linux is a multi-GB CUDA build);
- before "## The lessons" the only sections are the path: the quick start and building it yourself;
- the quick start runs no pytest over the whole suite (that is "## The whole suite", after the lessons);
- the reading time it states is the lesson docs' word count at the words a minute the lesson cards use
  (tests/test_docs.py), and the number of tasks is the build track's (scripts/build_track);
- no figure of the suite (its test counts, timings, slow or skipped tests, the AVX2 run) comes before
  "## The lessons": they are in docs/maintainers.md;
- every block .ci/run reads by its heading is there.

README_UNDER_TEST=path points these tests at another file (to see them fail on an older README).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from test_doc_claims import SEPARATORS, VALUED_OPTIONS, pytest_args, shell_words
from test_docs import LESSONS, READING_WORDS_PER_MINUTE, reading_words

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]
from build_track.tasks import lesson_tasks, lessons  # noqa: E402

README = Path(os.environ.get("README_UNDER_TEST", ROOT / "README.md"))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PATH_SECTIONS = ("Quick start", "Build it yourself")  # the only sections before the lessons table (prefixes)
APPENDICES = sorted((ROOT / "docs").glob("l*_appendix.md"))
HEADING = re.compile(r"^(#{2,6}) (.+?)\s*$", re.M)
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def text() -> str:
    return README.read_text()


def before_the_lessons() -> str:
    body = text()
    at = body.find("\n## The lessons")
    assert at >= 0, f"{README.name} has no '## The lessons' section (the lessons table)"
    return body[:at]


def ci_block(heading: str) -> str:
    """What .ci/run's awk line takes: from the first line starting with `## heading`, the first ```bash block on."""
    on = grab = False
    lines = []
    for line in text().splitlines():
        if line.startswith(f"## {heading}"):
            on = True
        if on and not grab and line.startswith("```bash"):
            grab = True
            continue
        if grab:
            if line.startswith("```"):
                break
            lines.append(line)
    return "\n".join(lines)


def commands(block: str) -> list[list[str]]:
    """Each command in a block, as the shell splits it at `&&`, `;` and `|` (comments dropped)."""
    found = []
    for line in block.splitlines():
        words = shell_words(line)
        assert words is not None, f"{README.name}: a line of the block does not parse as shell: {line!r}"
        argv: list[str] = []
        for word in words + [";"]:
            if word in SEPARATORS:
                if argv:
                    found.append(argv)
                argv = []
            else:
                argv.append(word)
    return found


def pip_installs(block: str) -> list[list[str]]:
    return [argv for argv in commands(block) if argv[:2] == ["pip", "install"]
            or argv[:4] in (["python", "-m", "pip", "install"], ["python3", "-m", "pip", "install"])]


def test_the_first_bash_block_is_the_quick_start_and_takes_torchs_cpu_build_first():
    body = text()
    bash = [m for m in FENCE.finditer(body) if m.group(1) == "bash"]
    assert bash, f"{README.name} has no ```bash block"
    first = bash[0]
    headings = [m for m in HEADING.finditer(body) if m.start() < first.start()]
    assert headings and headings[-1].group(2).startswith("Quick start"), (
        f"{README.name}'s first ```bash block sits under {headings[-1].group(2) if headings else 'no heading'!r}, not "
        "under '## Quick start': the first commands a newcomer copies are the quick start's, which CI runs as written")
    installs = pip_installs(first.group(2))
    assert installs, f"{README.name}'s quick start installs nothing with pip:\n{first.group(2)}"
    head = installs[0]
    assert any(w.startswith("torch") for w in head) and CPU_INDEX in head and "--index-url" in head, (
        f"{README.name}'s quick start runs `{' '.join(head)}` before taking torch from PyTorch's CPU index "
        f"(`pip install torch==X --index-url {CPU_INDEX}`): on Linux that pulls PyPI's multi-GB CUDA torch")


def test_only_the_path_comes_before_the_lessons():
    top = before_the_lessons()
    headings = [m.group(2) for m in HEADING.finditer(top)]
    extra = [h for h in headings if not h.startswith(PATH_SECTIONS)]
    assert not extra, (f"{README.name} has sections before '## The lessons' that are not the path (quick start, "
                       f"build it yourself): {extra}; move them after the lessons table")
    assert headings and headings[0].startswith("Quick start"), (
        f"{README.name}'s first section is {headings[0] if headings else None!r}, not the quick start")


def test_the_quick_start_runs_no_whole_suite():
    block = ci_block("Quick start")
    assert block, f"{README.name} has no ```bash block under '## Quick start' (.ci/run runs it first)"
    whole = []
    for argv in commands(block):
        args = pytest_args(argv)
        if args is None:
            continue
        targets, it = [], iter(args)
        for arg in it:
            if arg in VALUED_OPTIONS:
                next(it, None)
            elif not arg.startswith("-"):
                targets.append(arg)
        if not targets or any((ROOT / t.partition("::")[0]).is_dir() for t in targets):
            whole.append(" ".join(argv))
    assert not whole, (f"{README.name}'s quick start runs the whole test suite ({whole}): that takes many minutes; "
                       "it belongs under '## The whole suite'")


def stated(pattern: str, what: str) -> re.Match:
    m = re.search(pattern, " ".join(text().split()))
    assert m, f"{README.name} does not state {what} (in words like {pattern!r})"
    return m


def number(s: str) -> float:
    return float(s.replace(",", ""))


def assert_reading_time(what: str, words: float, hours: float, rate: int, docs: list[Path]) -> None:
    counted = sum(reading_words(d) for d in docs)
    assert abs(words - counted) <= 1000, (f"{README.name} says {what} are about {words:,.0f} words; they are "
                                          f"{counted:,} (Tasks sections aside, as the cards count)")
    assert abs(hours - counted / rate / 60) <= 0.25, (
        f"{README.name} says {what} take about {hours} hours; {counted:,} words at {rate} a minute is "
        f"{counted / rate / 60:.2f} hours")


def test_the_reading_time_is_the_docs_words_at_the_cards_rate():
    m = stated(r"lesson docs[^.]*? about ([\d,]+) words, about ([\d.]+) hours at (\d+) words a minute",
               "the lesson docs' reading time ('lesson docs ... about W words, about H hours at R words a minute')")
    rate = int(m.group(3))
    assert rate == READING_WORDS_PER_MINUTE, (
        f"{README.name} reads at {rate} words a minute; the lesson cards' reading times use "
        f"{READING_WORDS_PER_MINUTE} (tests/test_docs.py)")
    assert_reading_time("the lesson docs", number(m.group(1)), number(m.group(2)), rate, LESSONS)
    m = stated(r"appendices[^.]*? about ([\d,]+) words more, about ([\d.]+) hours",
               "the appendices' reading time ('appendices ... about W words more, about H hours')")
    assert_reading_time("the appendices", number(m.group(1)), number(m.group(2)), rate, APPENDICES)


def test_the_task_count_is_the_build_tracks():
    per_lesson = [len(lesson_tasks(ROOT, n)) for n in lessons(ROOT)]
    m = stated(r"(\d+) tasks \((\d+) to (\d+) each\)", "the number of tasks ('N tasks (A to B each)')")
    total, low, high = (int(g) for g in m.groups())
    assert total == sum(per_lesson), (f"{README.name} says {total} tasks; scripts/build_track counts "
                                      f"{sum(per_lesson)} over L1-L{len(per_lesson)} (`python scripts/course.py tasks LN`)")
    assert (low, high) == (min(per_lesson), max(per_lesson)), (
        f"{README.name} says {low} to {high} tasks a lesson; the lessons hold {min(per_lesson)} to {max(per_lesson)}")
    m = stated(r"estimate[^.]*? (\d+) to (\d+) minutes a task, (\d+) to (\d+) hours",
               "the building time, labelled an estimate ('estimate ... A to B minutes a task, X to Y hours')")
    lo_min, hi_min, lo_h, hi_h = (int(g) for g in m.groups())
    assert abs(lo_h - total * lo_min / 60) <= 1 and abs(hi_h - total * hi_min / 60) <= 1, (
        f"{README.name}: {total} tasks at {lo_min} to {hi_min} minutes is {total * lo_min / 60:.0f} to "
        f"{total * hi_min / 60:.0f} hours, not {lo_h} to {hi_h}")


TEST_COUNT = re.compile(r"(\d[\d,]*) tests?\b")
TIMING = re.compile(r"\d+(?:\.\d+)?\s*(?:min|minutes|s)\b")
SUITE_WORDS = re.compile(r"\bsuite\b|-n auto|\bslow\b")


def test_no_suite_figures_before_the_lessons():
    """The suite's counts and timings, its slow and skipped tests and the AVX2 run are in docs/maintainers.md."""
    top = " ".join(before_the_lessons().split())
    sentences = re.split(r"(?<=[.:;])\s+(?=[A-Z(`])", top)
    found = []
    for s in sentences:
        big = [c for c in TEST_COUNT.findall(s) if number(c) >= 1000]  # a lesson card's count is a few hundred
        if big:
            found.append(f"the suite's test count ({big[0]} tests)")
        if (big or SUITE_WORDS.search(s)) and TIMING.search(s):
            found.append(f"a suite timing ({TIMING.search(s).group(0)}: {s[:80]!r}...)")
    if re.search(r"-m\s+\"?(?:not )?slow|marked `?slow", top):
        found.append("the slow tests")
    if re.search(r"\d+ (?:tests? )?skip|skip \d+", top):
        found.append("a skip count")
    if re.search(r"AVX2|AVX-512", top):
        found.append("the AVX2 run")
    assert not found, (f"{README.name} shows the suite's details before '## The lessons': {found}; they belong in "
                       "docs/maintainers.md, with a pointer from '## The whole suite'")


def test_ci_finds_every_block_it_reads():
    """.ci/run reads README blocks by heading: each is there, and the whole suite's runs the tests CI counts on."""
    ci = (ROOT / ".ci" / "run").read_text()
    headings = re.findall(r"awk '/\^## ([^/]+)/", ci)
    assert {"Quick start", "The whole suite", "A real model"} <= set(headings), (
        f".ci/run reads the README blocks under {headings}; it should read the quick start's, the whole suite's and "
        "the real model's")
    missing = [h for h in headings if not ci_block(h)]
    assert not missing, f"{README.name} has no ```bash block under these headings .ci/run reads: {missing}"
    suite = ci_block("The whole suite")
    assert re.search(r'(^|[;&|]\s*)python -m pytest -q -n auto -m "not slow"\s*(&&|;|\||$)', suite, re.M), (
        f"{README.name}'s whole-suite block no longer runs `python -m pytest -q -n auto -m \"not slow\"`, which "
        ".ci/run's smoke loop relies on (doc_checked):\n" + suite)


@pytest.mark.parametrize("heading", ["Quick start", "The whole suite"])
def test_a_block_ci_runs_sits_under_its_heading(heading):
    """The block .ci/run takes is the section's own, not one further down."""
    body = text()
    start = next((m.start() for m in HEADING.finditer(body) if m.group(2).startswith(heading)), -1)
    assert start >= 0, f"{README.name} has no '## {heading}' section"
    nxt = body.find("\n## ", start + 1)
    section = body[start:nxt if nxt >= 0 else len(body)]
    assert "```bash" in section, f"{README.name}'s '## {heading}' has no ```bash block of its own"

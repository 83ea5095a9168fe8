"""The docs cannot drift from the code.

A doc quotes code by putting `<!-- quote: path/to/file.py:START-END -->` on the line right before a
fenced block; the block must equal lines START..END of that file (trailing whitespace ignored). Every
`lessons/...`, `shared/...`, `scripts/...` and `tests/...` path a doc names must exist (name a planned file
without its folder); a path with `*` or a `<placeholder>` in it must match at least one file.
An embedded picture must exist too. tests/test_doc_claims.py checks the commands the docs show.
"""
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
MARKER = re.compile(r"<!-- quote: (\S+?):(\d+)-(\d+) -->")
QUOTE = re.compile(r"^<!-- quote: (\S+?):(\d+)-(\d+) -->\n```[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
# Preceded by nothing path-like, so ../shared/COURSE.md and URLs are not read as paths in this repository.
PATH = re.compile(r"(?<![\w/.<>-])(?:lessons|shared|scripts|tests)/[\w/.*<>-]*")
PLACEHOLDER = re.compile(r"<[^<>/]*>")


def _exists(path: str) -> bool:
    """A plain path exists; a pattern (`tests/test_l3_*.py`, `scripts/l<N>_smoke.py`) matches something."""
    pattern = PLACEHOLDER.sub("*", path)
    if pattern == path and "*" not in path:
        return (ROOT / path).exists()
    return any(ROOT.glob(pattern.rstrip("/")))


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


def test_there_are_docs():
    assert (ROOT / "docs" / "README.md") in DOCS


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_code_matches_the_file(doc):
    text = doc.read_text()
    quotes = QUOTE.findall(text)
    assert len(quotes) == len(MARKER.findall(text)), f"{doc.name}: a quote marker is not followed by a fenced block"
    for path, start, end, body in quotes:
        source = ROOT / path
        assert source.is_file(), f"{doc.name} quotes {path}, which does not exist"
        start, end = int(start), int(end)
        wanted = _lines(source.read_text())[start - 1 : end]
        assert 1 <= start <= end and len(wanted) == end - start + 1, f"{doc.name}: {path}:{start}-{end} is out of range"
        assert _lines(body) == wanted, f"{doc.name}: the quote of {path}:{start}-{end} no longer matches the file"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(doc):
    named = {p.rstrip(".") for p in PATH.findall(doc.read_text())}  # a sentence's full stop is not part of it
    missing = sorted(p for p in named if not _exists(p))
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_embedded_images_exist(doc):
    """A picture a doc embeds (`![...](figures/x.png)`, relative to the doc) is a file in the repository."""
    missing = [src for src in IMAGE.findall(doc.read_text())
               if "://" not in src and not (doc.parent / src).is_file()]
    assert not missing, f"{doc.relative_to(ROOT)} embeds pictures that do not exist: {missing}"


LESSONS = sorted(p for p in (ROOT / "docs").glob("l*_*.md") if not p.stem.endswith("_appendix"))
MAIN_PATH_WORDS = 3000  # one sitting; how the big engines do it, full tables and load caveats go to an appendix
READING_WORDS_PER_MINUTE = 200  # technical prose read with the code beside it
CARD = ("**Goal:**", "**Builds on:**", "**Files:**", "**Tests:**", "**Reading time:**")
TESTS_FIELD = re.compile(r"\*\*Tests:\*\* `python -m pytest -q ([^`]+)`: ([\d,]+) tests?, about ([^.]+?) on ")
READING_FIELD = re.compile(r"\*\*Reading time:\*\* about (\d+) minutes? \(([\d,]+) words")


def reading_words(doc: Path) -> int:
    """The words a learner reads in the sitting: the doc without its Tasks section, a worksheet generated from the
    code (`scripts/course.py tasks LN --markdown`) and worked through over an evening, not read; nor the HTML
    comments (quote, numbers and mutation markers), which a reader never sees."""
    text = re.sub(r"<!--.*?-->", " ", doc.read_text(), flags=re.S)
    start = text.find("\n## Tasks: build it yourself")
    if start >= 0:
        text = text[:start] + text[text.index("\n## ", start + 1):]
    return len(text.split())


def card(doc: Path) -> str:
    """The lines between the title and the first section."""
    text = doc.read_text()
    start = text.index("\n") + 1
    return text[start:text.index("\n## ", start)]


@pytest.mark.parametrize("doc", LESSONS, ids=lambda p: p.name)
def test_a_lesson_reads_in_one_sitting(doc):
    """A lesson's main path is at most 3,000 words (its Tasks section aside); `docs/lN_<name>_appendix.md` holds what it
    links to."""
    words = reading_words(doc)
    assert words <= MAIN_PATH_WORDS, (f"{doc.name} has {words} words (at most {MAIN_PATH_WORDS}): move how the big "
                                      f"engines do it, full tables and load caveats to docs/{doc.stem}_appendix.md")
    appendix = doc.with_name(f"{doc.stem}_appendix.md")
    if appendix.exists():
        assert appendix.name in doc.read_text(), f"{doc.name} does not link its appendix {appendix.name}"


@pytest.mark.parametrize("doc", LESSONS, ids=lambda p: p.name)
def test_a_lesson_opens_with_its_card(doc):
    """Goal, builds on, files, the test command with its count and time, and the reading time, in that order,
    each at a line's start before the first section; the reading time fits the doc's words."""
    head = card(doc)
    at = [next((m.start() for m in re.finditer(re.escape(field), head) if m.start() == 0 or head[m.start() - 1] == "\n"),
               -1) for field in CARD]
    assert -1 not in at, f"{doc.name}'s card lacks {CARD[at.index(-1)]} at a line's start"
    assert at == sorted(at), f"{doc.name}'s card fields are out of order: {' '.join(CARD)}"
    flat = " ".join(head.split())
    assert TESTS_FIELD.search(flat), (f"{doc.name}: the card's tests read '**Tests:** `python -m pytest -q FILES`: N "
                                      "tests, about TIME on <machine>'")
    reading = READING_FIELD.search(flat)
    assert reading, f"{doc.name}: the card's reading time reads '**Reading time:** about M minutes (W words'"
    words, stated = reading_words(doc), int(reading.group(2).replace(",", ""))
    assert abs(stated - words) <= 150, f"{doc.name}: the card says {stated} words, the doc has {words}"
    minutes = int(reading.group(1))
    assert abs(minutes - words / READING_WORDS_PER_MINUTE) <= 1, (
        f"{doc.name}: {words} words at {READING_WORDS_PER_MINUTE} a minute is about "
        f"{round(words / READING_WORDS_PER_MINUTE)} minutes, not {minutes}")


def card_files(command: str) -> list[str]:
    """The test files a card's command names (its arguments are paths or globs)."""
    return sorted({str(p.relative_to(ROOT)) for arg in shlex.split(command) for p in ROOT.glob(arg)})


@lru_cache(maxsize=1)
def collected_per_file() -> dict[str, int]:
    """Tests per file, for every file a lesson card names, from one `pytest --collect-only` run."""
    commands = [m.group(1) for doc in LESSONS if (m := TESTS_FIELD.search(" ".join(card(doc).split())))]
    files = sorted({f for command in commands for f in card_files(command)})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         cwd=ROOT, capture_output=True, text=True, timeout=600).stdout
    per_file: dict[str, int] = {}
    for line in out.splitlines():
        if "::" in line:
            name = line.split("::")[0]
            per_file[name] = per_file.get(name, 0) + 1
    return per_file


@pytest.mark.parametrize("doc", LESSONS, ids=lambda p: p.name)
def test_a_lesson_cards_test_count_is_what_pytest_collects(doc):
    fields = TESTS_FIELD.search(" ".join(card(doc).split()))
    assert fields, f"{doc.name} has no test command in its card"
    command, stated = fields.group(1), int(fields.group(2).replace(",", ""))
    got = sum(collected_per_file().get(f, 0) for f in card_files(command))
    assert got == stated, f"{doc.name}: `python -m pytest -q {command}` collects {got} tests; the card says {stated}"


@pytest.mark.parametrize("doc", LESSONS, ids=lambda p: p.name)
def test_a_lesson_ends_with_its_smoke_and_next(doc):
    """The last section is the smoke, with its expected output; the last paragraph says what comes next."""
    text = doc.read_text()
    last = text[text.rindex("\n## ") + 1:]
    assert last.startswith("## The smoke"), f"{doc.name}'s last section is {last.splitlines()[0]!r}, not '## The smoke'"
    assert "<!-- output" in last, f"{doc.name}'s smoke section shows no expected output (an <!-- output --> block)"
    paragraphs = [p for p in last.strip().split("\n\n") if p.strip()]
    assert paragraphs[-1].startswith("**Next:**"), f"{doc.name} does not end with a **Next:** paragraph"


LINK = re.compile(r"\]\(([\w./-]*\.md)?#([\w-]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_section_links_land_on_a_heading(doc):
    """`[text](other.md#section)` and `[text](#section)`: the section exists (a moved section breaks no link)."""
    broken = []
    for target, anchor in LINK.findall(doc.read_text()):
        path = (doc.parent / target) if target else doc
        if not path.exists():
            continue  # test_named_paths_exist's business
        anchors = {slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}
        if anchor not in anchors:
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{doc.name} links to sections that do not exist: {broken}"

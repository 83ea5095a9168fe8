"""The docs cannot drift from the code.

A doc quotes code by putting `<!-- quote: path/to/file.py:START-END -->` on the line right before a
fenced block; the block must equal lines START..END of that file (trailing whitespace ignored). Every
`lessons/...`, `shared/...`, `scripts/...` and `tests/...` path a doc names must exist (name a planned file
without its folder); a path with `*` or a `<placeholder>` in it must match at least one file.
An embedded picture must exist too. tests/test_doc_claims.py checks the commands the docs show.
"""
import re
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
MAIN_PATH_WORDS = 4500  # about what one sitting holds; measurement logs and reference detail go to an appendix


@pytest.mark.parametrize("doc", LESSONS, ids=lambda p: p.name)
def test_a_lesson_reads_in_one_sitting(doc):
    """A lesson's main path stays near 4,000 words; `docs/lN_<name>_appendix.md` holds what it links to."""
    words = len(doc.read_text().split())
    assert words <= MAIN_PATH_WORDS, (f"{doc.name} has {words} words (at most {MAIN_PATH_WORDS}): move measurement "
                                      f"logs and reference detail to docs/{doc.stem}_appendix.md and link it")
    appendix = doc.with_name(f"{doc.stem}_appendix.md")
    if appendix.exists():
        assert appendix.name in doc.read_text(), f"{doc.name} does not link its appendix {appendix.name}"

"""A lesson card's **Files:** line names the lesson folder's files, so a reader who opens the folder finds nothing
the card kept quiet about.

What counts, decided once for every lesson:

- Every source file under `lessons/lN_<name>/`, in subfolders too: `.py`, and the C++ (`.cpp`) the lessons
  compile, since a kernel is as much the lesson as its Python.
- `__init__.py` is exempt only when it is empty. None is today: each lesson's holds its docstring, the engine
  it exports and the `ROLES` that scripts/lesson_diff.py reads (L3's `backends/__init__.py` picks the backend),
  so a card names it or counts it among its smaller ones.
- A file is named when a code span on the Files line is its path in the folder (`backends/base.py`), its path
  from the repository root, or its bare file name where no other file in the folder has that name.
- A card may leave files unnamed only with a count, "and N ones" / "and N more": N must equal the number of
  files it leaves unnamed. "and N smaller ones" also promises each of them has fewer lines than every `.py` file
  the card names; where that is false, the card names the larger files or drops "smaller".
- A bare file name on the Files line is a file in the folder (a rename fails here, not in a reader's shell).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs import LESSONS, ROOT, card

SOURCES = {".py", ".cpp"}
SPAN = re.compile(r"`([^`]+)`")
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
         "ten": 10, "eleven": 11, "twelve": 12}
COUNTED = re.compile(r"\band (\d+|" + "|".join(WORDS) + r") (smaller )?(?:ones?|more|others?)\b")


def files_field(doc: Path) -> str:
    """The card's Files line(s), joined into one line."""
    head = card(doc)
    start = head.index("**Files:**")
    end = head.index("**Tests:**", start)
    return " ".join(head[start:end].split())


def lesson_folder(doc: Path) -> Path:
    number = doc.name.split("_")[0]  # "l14"
    folders = sorted((ROOT / "lessons").glob(f"{number}_*/"))
    assert len(folders) == 1, f"{doc.name}: expected one folder lessons/{number}_*/, found {folders}"
    return folders[0]


def sources(folder: Path) -> dict[str, Path]:
    """Path in the folder -> file, for every source file that must be accounted for (an empty __init__.py is not)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix not in SOURCES or "__pycache__" in path.parts or not path.is_file():
            continue
        if path.name == "__init__.py" and not path.read_text().strip():
            continue
        out[str(path.relative_to(folder))] = path
    return out


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def named(field: str, folder: Path, files: dict[str, Path]) -> set[str]:
    spans = set(SPAN.findall(field))
    prefix = f"{folder.relative_to(ROOT)}/"
    basenames = [Path(rel).name for rel in files]
    return {rel for rel in files
            if rel in spans or prefix + rel in spans or (Path(rel).name in spans and basenames.count(Path(rel).name) == 1)}


@pytest.mark.parametrize("doc", LESSONS, ids=lambda p: p.name)
def test_the_card_names_every_file_of_its_lesson(doc):
    field, folder = files_field(doc), lesson_folder(doc)
    files = sources(folder)
    on_card = named(field, folder, files)
    unnamed = sorted(set(files) - on_card)
    lesson = f"{doc.name} ({folder.relative_to(ROOT)}/)"
    counted = COUNTED.search(field)
    if counted is None:
        assert not unnamed, (f"{lesson}: the card's Files line does not name {len(unnamed)} of the folder's "
                             f"{len(files)} files: {unnamed}; name each, with what it holds")
        return
    problems = []
    said = WORDS.get(counted.group(1)) or int(counted.group(1))
    if said != len(unnamed):
        problems.append(f"the card says '{counted.group(0)}' ({said}), but {len(unnamed)} files are unnamed: {unnamed}")
    if counted.group(2):  # "smaller"
        named_py = {rel: lines(files[rel]) for rel in on_card if rel.endswith(".py")}
        smallest = min(named_py.items(), key=lambda kv: kv[1])
        larger = [f"{rel} ({lines(files[rel])} lines)" for rel in unnamed if lines(files[rel]) >= smallest[1]]
        if larger:
            problems.append(f"the card calls its {len(unnamed)} unnamed files smaller, but {len(larger)} of them are "
                            f"not smaller than {smallest[0]} ({smallest[1]} lines), the smallest it names: {larger}")
    assert not problems, f"{lesson}: " + "; and ".join(problems)

@pytest.mark.parametrize("doc", LESSONS, ids=lambda p: p.name)
def test_a_bare_file_name_on_the_card_is_in_the_folder(doc):
    field, folder = files_field(doc), lesson_folder(doc)
    names = {Path(rel).name for rel in sources(folder)} | {rel for rel in sources(folder)}
    bare = [s for s in SPAN.findall(field)
            if Path(s).suffix in SOURCES and not s.startswith(("lessons/", "scripts/", "tests/", "shared/"))]
    gone = sorted(s for s in bare if s not in names)
    assert not gone, f"{doc.name}: the card names {len(gone)} files that {folder.relative_to(ROOT)}/ lacks: {gone}"

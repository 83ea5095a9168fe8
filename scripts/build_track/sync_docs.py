"""Maintainers: write each lesson doc's Tasks section, generated from the markers, before its smoke section.

`python scripts/build_track/sync_docs.py [L2 L3 ...]` (default: every lesson with tasks); the section is what
`python scripts/course.py tasks LN --markdown` prints, and tests/test_build_track.py holds each doc to it."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's lessons/ and shared/, not an installed course's
from course import ROOT, doc_for, markdown  # noqa: E402
from build_track.tasks import TaskError, lesson_tasks, lessons  # noqa: E402

HEADING = "\n## Tasks: build it yourself"


def sync(lesson: int) -> bool:
    doc = doc_for(lesson)
    text = doc.read_text()
    if (start := text.find(HEADING)) >= 0:
        text = text[:start] + text[text.index("\n## ", start + 1):]
    at = text.rindex("\n## The smoke")
    new = text[:at] + "\n" + markdown(lesson) + text[at:]
    changed = new != doc.read_text()
    doc.write_text(new)
    return changed


if __name__ == "__main__":
    from course import lesson_number
    from shared.cli import OneLineParser

    parser = OneLineParser(prog="sync_docs.py", description=__doc__.split("\n")[0])
    parser.add_argument("lessons", nargs="*", help="L2 L3 ... (default: every lesson with tasks)")
    args = parser.parse_args()
    try:
        wanted = [lesson_number(a) for a in args.lessons] or [n for n in lessons(ROOT) if lesson_tasks(ROOT, n)]
    except TaskError as e:
        parser.error(str(e))
    for n in wanted:
        print(f"L{n}: {'written' if sync(n) else 'unchanged'}")

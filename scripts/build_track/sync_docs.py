"""Maintainers: write each lesson doc's generated Tasks section (`course.py tasks LN --markdown`) in place, just before
its smoke section: `python scripts/build_track/sync_docs.py [L2 L3 ...]` (default: every lesson with tasks)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from course import ROOT, markdown  # noqa: E402
from build_track.tasks import lesson_folder, lesson_tasks, lessons  # noqa: E402

HEADING = "\n## Tasks: build it yourself"


def sync(lesson: int) -> bool:
    doc = ROOT / "docs" / f"{lesson_folder(ROOT, lesson).name}.md"
    text = doc.read_text()
    if (start := text.find(HEADING)) >= 0:
        text = text[:start] + text[text.index("\n## ", start + 1):]
    at = text.rindex("\n## The smoke")
    new = text[:at] + "\n" + markdown(lesson) + text[at:]
    changed = new != doc.read_text()
    doc.write_text(new)
    return changed


if __name__ == "__main__":
    wanted = [int(a.lstrip("Ll")) for a in sys.argv[1:]] or [n for n in lessons(ROOT) if lesson_tasks(ROOT, n)]
    for n in wanted:
        print(f"L{n}: {'written' if sync(n) else 'unchanged'}")

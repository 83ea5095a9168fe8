"""Each lesson doc's pitfalls and planted-bug exercises, held to the build track: every one names a mutation
(scripts/checks/mutations.py) in its item, as `<!-- mutation: ID -->` or in a `<!-- numbers: mutation ID ... -->`
region, and `course.py verify LN` plants each into a workspace with every task filled in and requires that the task
owning the mutated code fails its own tests, with a message a learner can act on (an assertion's own words, not
`assert [0, 1] == []` or `DID NOT RAISE`).

An item that is not a planted bug (a design question, a feature to add, a pitfall that lives in the appendix) says
so: `<!-- no mutation: why -->`. A mutation in code no task owns (the HF oracle, the tiny model's builder) is
planted too; its own tests must catch it, and verify says no task owns it.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from build_track.tasks import TaskError, lesson_tasks, lessons, marked_functions

SECTION = re.compile(r"^## (Pitfalls|Exercise)", re.M)
ITEM = re.compile(r"^(?:\d+\.|-) ", re.M)
NAMED = re.compile(r"<!-- (?:mutation:|numbers: mutation) ([\w-]+)")
EXEMPT = re.compile(r"<!-- no mutation: (.+?) -->", re.S)
LESSON_PATH = re.compile(r"^lessons/l(\d+)_")


@dataclass(frozen=True)
class Item:
    """One pitfall or exercise of a doc: its section, its first line, the mutations it names, or why none."""
    section: str
    title: str
    mutations: tuple[str, ...]
    exempt: str  # the reason given, or ""


def doc_items(text: str) -> list[Item]:
    """The top-level list items of each Pitfalls/Exercise section (a section with no list is one item)."""
    items = []
    starts = [m.start() for m in SECTION.finditer(text)]
    for start in starts:
        end = text.find("\n## ", start + 1)
        section = text[start:end if end >= 0 else len(text)]
        heading, _, body = section.partition("\n")
        cuts = [m.start() for m in ITEM.finditer(body)]
        chunks = [body[a:b] for a, b in zip(cuts, cuts[1:] + [len(body)])] if cuts else [body]
        for chunk in chunks:
            title = next((line.strip() for line in chunk.splitlines() if line.strip()), "")[:80]
            exempt = EXEMPT.search(chunk)
            items.append(Item(heading.removeprefix("## "), title, tuple(dict.fromkeys(NAMED.findall(chunk))),
                              " ".join(exempt.group(1).split()) if exempt else ""))
    return items


def owner(root: Path, file: str, old: str) -> tuple[int, int] | None:
    """(lesson, task) whose marked function holds the snippet `old` of `file`, or None (code no task owns)."""
    match = LESSON_PATH.match(file)
    path = root / file
    if not match or not path.is_file() or path.suffix != ".py":
        return None
    text = path.read_text()
    at = text.find(old)
    if at < 0:
        return None
    first, last = text.count("\n", 0, at) + 1, text.count("\n", 0, at + len(old)) + 1
    for lesson, number, _title, _qualname, node in marked_functions(text):
        if node.lineno <= first and last <= node.end_lineno:
            return lesson, number
    return None


def in_learners_terms(message: str) -> bool:
    """A failure a learner can act on: the test's own words (an assertion message, pytest.fail's text), not a bare
    comparison, a missing raise, a tensor diff, or an exception from deep inside the code."""
    first = (message.splitlines() or [""])[0]
    said = first.removeprefix("AssertionError: ").removeprefix("Failed: ")
    if said == first:  # neither an assertion nor pytest.fail: an IndexError in the code under test, say
        return False
    return bool(said.strip()) and not re.match(r"assert |DID NOT RAISE|Tensor-likes are not|Scalars are not", said)


def mutations():
    """({id: Mutation}, plant) from scripts/checks/mutations.py."""
    checks = str(Path(__file__).resolve().parents[1] / "checks")
    if checks not in sys.path:
        sys.path.insert(0, checks)
    from mutations import MUTATIONS, plant

    return {m.id: m for m in MUTATIONS}, plant


def verify_planted(root: Path, lesson: int, doc: Path, timeout: float = 600) -> tuple[list[str], list[str]]:
    """Plant every mutation `doc` names into a workspace of the owning lesson with all its tasks filled in, and run
    the owning task's tests (or, for code no task owns, the mutation's own tests). Returns (problems, report lines)."""
    import tempfile

    from build_track.workspace import run_pytest, run_tests, start

    known, plant = mutations()
    problems, report = [], []
    items = doc_items(doc.read_text())
    for item in items:
        if not item.mutations and not item.exempt:
            problems.append(f"{doc.name}, {item.section}: `{item.title}` names no mutation (<!-- mutation: ID -->) "
                            "and says no reason (<!-- no mutation: why -->)")
    wanted = [i for item in items for i in item.mutations]
    problems += [f"{doc.name} names mutation {i!r}, which scripts/checks/mutations.py lacks" for i in wanted
                 if i not in known]
    with tempfile.TemporaryDirectory() as tmp:
        workspaces: dict[int, Path] = {}
        for mid in dict.fromkeys(i for i in wanted if i in known):
            m = known[mid]
            owners = {o for file, old, _new in m.edits() if (o := owner(root, file, old))}
            if len(owners) > 1:
                problems.append(f"{mid}: its edits touch tasks {sorted(owners)}: plant one task's mistake")
                continue
            # code no task owns (shared/, the oracle) is tested by files of any lesson: the whole course's copy
            home = next(iter(owners))[0] if owners else max(lessons(root))
            if home not in workspaces:
                workspaces[home] = Path(tmp) / f"l{home}"
                start(root, home, workspaces[home], cache=None)
                for task_file in {f.path for t in lesson_tasks(root, home) for f in t.functions}:
                    (workspaces[home] / task_file).write_text((root / task_file).read_text())  # all filled in
            workspace = workspaces[home]
            try:
                originals = plant(m, workspace)
            except ValueError as e:
                problems.append(f"{mid}: {e} (in L{home}'s workspace)")
                continue
            try:
                if owners:
                    task = next(iter(owners))[1]
                    results = run_tests(workspace, home, task, timeout=timeout, fork=True)
                    failed = [r for r in results if not r.passed]
                    where = f"L{home} task {task}"
                    if not results:
                        problems.append(f"{mid}: {where}'s tests did not run")
                    elif not failed:
                        problems.append(f"{mid}: {where}'s {len(results)} tests all pass with it planted")
                    else:
                        said = failed[0].message.splitlines()[0] if failed[0].message else ""
                        report.append(f"{mid}: {where} fails ({len(failed)} of {len(results)}): "
                                      f"{failed[0].nodeid.split('::')[-1]}: {said}")
                        if not any(in_learners_terms(r.message) for r in failed):
                            problems.append(f"{mid}: {where} fails, but not in a learner's terms: {said}")
                else:
                    code = run_pytest(workspace, list(m.tests), timeout)
                    if code == 1:
                        report.append(f"{mid}: no task owns {m.file}; its own tests fail: {' '.join(m.tests)}")
                    else:
                        problems.append(f"{mid}: no task owns {m.file}, and its own tests exit {code}, not 1 (a "
                                        "failure)")
            except TaskError as e:
                problems.append(f"{mid}: {e}")
            finally:
                for path, text in originals.items():
                    path.write_text(text)
    return problems, report

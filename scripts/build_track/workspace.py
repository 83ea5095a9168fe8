"""A learner's workspace: a copy of the course with the lessons up to N, lesson N's task functions stubbed, and the
tests of those lessons; where it is, and how its task tests stand.

The copy lives outside the reference tree (a folder the learner names). `.course.json` in it records the lesson
and the reference it was made from; the cache folder remembers the last workspace made for each lesson, so
`course.py check L2` finds it from anywhere.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from build_track.tasks import Task, TaskError, lesson_folder, lesson_tasks, stub_text

STATE = ".course.json"
TEST_LESSONS = re.compile(r"_l(\d+)")  # test_l1_l2_parity.py -> 1, 2
ROOT_OF_COURSE = Path(__file__).resolve().parents[2]
HELPERS = ("conftest.py", "fake_runner.py", "l10_fault.py")  # tests/ modules that are not tests


def _remembered(cache: Path) -> Path:
    return cache / "build-track.json"


CARD_TESTS = re.compile(r"^\*\*Tests:\*\* `python -m pytest[^`]*`", re.M)


def card_test_files(root: Path, lesson: int) -> list[Path]:
    """The test files the command on lesson `lesson`'s card names (its globs expanded)."""
    docs = [p for p in (root / "docs").glob(f"l{lesson}_*.md") if not p.stem.endswith("_appendix")]
    card = CARD_TESTS.search(docs[0].read_text()) if len(docs) == 1 else None
    if card is None:
        return []
    return sorted({p for word in card.group(0).split() if word.strip("`").startswith("tests/")
                   for p in root.glob(word.strip("`"))})


def wanted_test_files(root: Path, lesson: int) -> list[Path]:
    """tests/ files a workspace of `lesson` holds: helpers, every lesson test file of lessons <= lesson, and every
    file the cards of those lessons name (L2's names tests/test_bad_input.py)."""
    files = [root / "tests" / h for h in HELPERS if (root / "tests" / h).exists()]
    for path in sorted((root / "tests").glob("test_l*.py")):
        numbers = [int(n) for n in TEST_LESSONS.findall(path.stem)]
        if numbers and max(numbers) <= lesson:
            files.append(path)
    for below in range(1, lesson + 1):
        files += [p for p in card_test_files(root, below) if p not in files]
    return files


def start(root: Path, lesson: int, into: Path, cache: Path | None) -> list[Task]:
    """Make the workspace; returns the lesson's tasks. Raises TaskError (one line) on a folder it must not use."""
    into = into.expanduser().resolve()
    if into == root or root in into.parents:
        raise TaskError(f"--into {into} is inside the course itself; name a folder outside {root}")
    if into.exists() and any(into.iterdir()):
        hint = "name a new folder"
        try:
            made = json.loads((into / STATE).read_text()).get("lesson")
            hint += (f", or go on with the workspace there: `python scripts/course.py check L{made} --in {into}` "
                     f"(`reset L{made} --task K --in {into}` puts one task's stub back)")
        except (OSError, ValueError):
            pass
        raise TaskError(f"--into {into} exists and is not empty; {hint}")
    tasks = lesson_tasks(root, lesson)
    if not tasks:
        raise TaskError(f"L{lesson} has no tasks yet")
    into.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in sorted((root / "lessons").iterdir()):
        m = re.match(r"l(\d+)_", folder.name)
        if folder.is_dir() and (m is None or int(m.group(1)) <= lesson):
            shutil.copytree(folder, into / "lessons" / folder.name, ignore=ignore)
    for extra in ("lessons/__init__.py", "pyproject.toml"):
        if (root / extra).exists():
            (into / extra).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / extra, into / extra)
    shutil.copytree(root / "shared", into / "shared", ignore=ignore)
    shutil.copytree(root / "scripts", into / "scripts", ignore=ignore)
    (into / "tests").mkdir()
    for path in wanted_test_files(root, lesson):
        shutil.copy2(path, into / "tests" / path.name)
    stub_files(into, lesson, {t.number for t in tasks})
    write_docs(root, lesson, into)
    (into / STATE).write_text(json.dumps({"lesson": lesson, "reference": str(root)}, indent=1) + "\n")
    if cache is not None:
        remember(cache, lesson, into)
    return tasks


def write_docs(root: Path, lesson: int, into: Path) -> None:
    """docs/ for the workspace: the lessons below as they are, `lesson`'s doc and appendix in the learner's edition
    (each quoted task body replaced by its contract), no later lesson's."""
    from build_track.learner_doc import DOC_LESSON, learners_edition

    (into / "docs").mkdir()
    for path in sorted((root / "docs").iterdir()):
        m = DOC_LESSON.match(path.name)
        if path.is_dir():
            shutil.copytree(path, into / "docs" / path.name)
        elif m is None or int(m.group(1)) < lesson:
            shutil.copy2(path, into / "docs" / path.name)
        elif int(m.group(1)) == lesson:
            (into / "docs" / path.name).write_text(learners_edition(root, lesson, path.read_text()))


def stub_files(workspace: Path, lesson: int, numbers: set[int]) -> None:
    """Stub the given tasks of `lesson` in the workspace's own files."""
    for path in sorted(lesson_folder(workspace, lesson).rglob("*.py")):
        text = path.read_text()
        stubbed = stub_text(text, numbers, lesson)
        if stubbed != text:
            path.write_text(stubbed)


def remember(cache: Path, lesson: int, workspace: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    try:
        known = json.loads(_remembered(cache).read_text())
    except (OSError, ValueError):
        known = {}
    known[f"L{lesson}"] = str(workspace)
    _remembered(cache).write_text(json.dumps(known, indent=1) + "\n")


def find(lesson: int, given: Path | None, cache: Path) -> Path:
    """The workspace for `lesson`: --in, else the one the current folder is in, else the last one started."""
    candidates = []
    if given is not None:
        candidates = [given.expanduser().resolve()]
    else:
        here = Path.cwd().resolve()
        candidates = [p for p in (here, *here.parents) if (p / STATE).exists()][:1]
        if not candidates:
            try:
                known = json.loads(_remembered(cache).read_text())
            except (OSError, ValueError):
                known = {}
            if f"L{lesson}" in known:
                candidates = [Path(known[f"L{lesson}"])]
    if not candidates:
        raise TaskError(f"no workspace for L{lesson}: make one with `python scripts/course.py start L{lesson} --into DIR`")
    workspace = candidates[0]
    try:
        state = json.loads((workspace / STATE).read_text())
    except (OSError, ValueError):
        raise TaskError(f"{workspace} is not a course workspace (no {STATE})") from None
    if state.get("lesson") != lesson:
        raise TaskError(f"{workspace} is L{state.get('lesson')}'s workspace, not L{lesson}'s")
    return workspace


def reference_of(workspace: Path) -> Path:
    """The course tree a workspace was made from (course.py may be run from the workspace's own copy)."""
    return Path(json.loads((workspace / STATE).read_text())["reference"])


@dataclass
class TestResult:
    nodeid: str
    task: str  # L2.3
    passed: bool
    message: str  # the failure in one or a few lines; empty when passed


def run_tests(workspace: Path, lesson: int, task: int | None = None, timeout: float = 1800,
              fork: bool = False, through: int | None = None) -> list[TestResult]:
    """Run the workspace's task tests of `lesson` (or of one task, or of tasks `task`..`through`) in a fresh
    process; one result per test.
    `fork`: fork this process instead of starting Python (verify's many runs; torch and pytest are imported once,
    here, and the lessons never are, so the child imports the workspace's)."""
    files = sorted({t.split("::")[0] for k in lesson_tasks(workspace, lesson) for t in k.tests
                    if task is None or task <= k.number <= (through or task)})
    if not files:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        selected = f"L{lesson}" if task is None else f"L{lesson}.{task}" + (f"-{through}" if through else "")
        # --tb=no: the report holds each failure's message; tracebacks of a hundred stubs took a second a run.
        # No hypothesis plugin: no task test uses hypothesis, and the plugin imports it at every session's end
        # (1.8 s a run: a quarter of verify's time, and of a learner's `check`).
        args = ["-q", "--tb=no", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:hypothesispytest",
                f"--tasks={selected}", f"--tasks-report={report}", *files]
        if fork:
            _forked_pytest(workspace, args, timeout)
        else:
            env = {**os.environ, "PYTHONPATH": str(workspace)}
            env.pop("PYTEST_ADDOPTS", None)
            try:
                subprocess.run([sys.executable, "-m", "pytest", *args], cwd=workspace, env=env, capture_output=True,
                               text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise TaskError(f"L{lesson}'s task tests ran past {timeout:.0f} s in {workspace}") from None
        if not report.exists():
            raise TaskError(f"the task tests did not run in {workspace} (pytest wrote no report: a file that does "
                            "not import? run `python -m pytest -q` there to see)")
        return [TestResult(**row) for row in json.loads(report.read_text())]


_warmed = False


def _warm() -> None:
    """What every run of task tests pays first, paid once before the forks: torch's and transformers' imports and
    the first load of each model (about 2.5 s a run on a 2-core EPYC). One torch thread: a process that forks
    must not have started an OpenMP pool, and the children run their tests on one thread too."""
    global _warmed
    if _warmed:
        return
    import torch
    from shared.hf_reference import HfReference
    from shared.model import Qwen3ForCausalLM
    from shared.tiny_qwen3 import default_model_dir

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    Qwen3ForCausalLM.from_dir(default_model_dir(), torch.float32, torch.device("cpu"))
    HfReference(default_model_dir(), torch.float32, torch.device("cpu"))
    _warmed = True


def run_pytest(workspace: Path, tests: list[str], timeout: float) -> int:
    """pytest's exit status for `tests` (node ids, files, -k EXPR) run in the workspace, in a fresh process: unlike
    a fork of verify's process, it imports the workspace's shared/ too (a mutation there must be seen)."""
    args = ["-q", "--tb=no", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:hypothesispytest", *tests]
    env = {**os.environ, "PYTHONPATH": str(workspace)}
    env.pop("PYTEST_ADDOPTS", None)
    try:
        return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=workspace, env=env, capture_output=True,
                              timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        raise TaskError(f"{' '.join(tests)} ran past {timeout:.0f} s in {workspace}") from None


def _forked_pytest(workspace: Path, args: list[str], timeout: float) -> None:
    """pytest.main(args) in a forked child, in the workspace, its output discarded (the report is the result)."""
    import pytest

    _warm()
    if any(name == "lessons" or name.startswith("lessons.") for name in sys.modules):
        raise TaskError("verify's process has imported the reference lessons; a forked run would test them")
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 3
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.chdir(workspace)
            sys.path[:] = [str(workspace)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT_OF_COURSE]
            code = pytest.main(args)
        finally:
            os._exit(int(code))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise TaskError(f"the task tests ran past {timeout:.0f} s in {workspace}")


def restore(workspace: Path, root: Path, lesson: int, numbers: set[int]) -> Path:
    """Put the reference's stubs of the given tasks back (and leave every other function as the learner has it):
    each stubbed function's text is swapped in the learner's file, found by its name. The files as they were go
    to a backup folder first, `.course-backups/<time>/` in the workspace, which is returned."""
    from build_track.tasks import function_source

    backup = workspace / ".course-backups" / time.strftime("%Y%m%d-%H%M%S")
    while backup.exists():  # two resets in one second
        backup = backup.with_name(backup.name + "+")
    touched = {fn.path for task in lesson_tasks(root, lesson) if task.number in numbers for fn in task.functions}
    for path in sorted(touched):
        (backup / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(workspace / path, backup / path)

    for task in lesson_tasks(root, lesson):
        if task.number not in numbers:
            continue
        for fn in task.functions:
            stub = function_source(stub_text((root / fn.path).read_text(), {task.number}, lesson), fn.qualname)
            mine_path = workspace / fn.path
            mine = mine_path.read_text()
            current = function_source(mine, fn.qualname)
            if not current:
                raise TaskError(f"{fn.path} no longer has `{fn.qualname}`")
            mine_path.write_text(mine.replace(current, stub, 1))
    return backup


def verify(root: Path, lesson: int, timeout: float = 1800) -> list[str]:
    """Hold every task of `lesson` to its promise, as a learner meets it: with nothing filled in, every task's
    tests fail (the learner's first `check`); with tasks 1..k filled in (the reference) and the rest stubbed, task
    k's tests pass and task k+1's fail, for k = 1..n. So each task's tests fail with its stub in and everything
    before it done, and pass once it is done with everything after it still stubbed. (Each state runs only those
    two tasks' tests, which keeps CI's time; the whole suite runs every test with the reference.)
    Returns the problems found, one line each (none: the lesson's build track holds)."""
    tasks = lesson_tasks(root, lesson)
    problems = [f"{t.id} has no test marked for it" for t in tasks if not t.tests]
    with tempfile.TemporaryDirectory() as tmp:
        workspace = Path(tmp) / "ws"
        start(root, lesson, workspace, cache=None)
        for k in range(len(tasks) + 1):
            for path in sorted(lesson_folder(root, lesson).rglob("*.py")):  # the reference, then the later stubs
                target = workspace / path.relative_to(root)
                target.write_text(stub_text(path.read_text(), {t.number for t in tasks[k:]}, lesson))
            checked = tasks if k == 0 else tasks[k - 1 : k + 1]
            results = run_tests(workspace, lesson, None if k == 0 else k, timeout=timeout, fork=True,
                                through=None if k == 0 else min(k + 1, len(tasks)))
            ran = {r.nodeid.split("[")[0] for r in results}
            problems += [f"tasks 1..{k} filled in: {test} did not run" for t in checked for test in t.tests
                         if test not in ran]
            for result in results:
                number = int(result.task.split(".")[1])
                if number <= k and not result.passed:
                    problems.append(f"tasks 1..{k} filled in: {result.nodeid} ({result.task}) fails: "
                                    f"{result.message.splitlines()[0] if result.message else ''}")
                if number > k and result.passed:
                    problems.append(f"tasks 1..{k} filled in: {result.nodeid} ({result.task}) passes with its "
                                    "stub in: it cannot catch the task undone")
    return problems

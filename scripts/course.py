"""The build track: implement each lesson's functions yourself, task by task, with tests that say when each is done.

    python scripts/course.py tasks L2                  # the tasks, in order: what, where, which tests
    python scripts/course.py start L2 --into ~/l2      # a workspace: L1 complete, L2's task functions stubbed
    python scripts/course.py check L2 [--task 3]       # where you stand; the smoke's parity once all pass
    python scripts/course.py diff L2 [--task 3]        # your functions beside the reference's
    python scripts/course.py reset L2 --task 3         # put task 3's stub back
    python scripts/course.py verify L2                 # maintainers: every task fails stubbed, passes filled in,
                                                       # and fails with each of the doc's pitfalls planted

Tasks are marked in the lessons' own code (`# Task L2.3: ...` above a function) and their tests with
`@pytest.mark.task("L2.3")`: the reference solution is the lesson itself. See scripts/build_track/.
"""
from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
from build_track.tasks import Task, TaskError, function_source, lesson_tasks, lessons  # noqa: E402
from build_track.planted import verify_planted  # noqa: E402
from build_track.workspace import find, reference_of, restore, run_tests, start, verify  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.tiny_qwen3 import cache_root  # noqa: E402


def lesson_number(text: str) -> int:
    match = re.fullmatch(r"[Ll]?(\d+)", text)
    if not match or int(match.group(1)) not in lessons(ROOT):
        raise TaskError(f"lesson {text!r}: name one of L{min(lessons(ROOT))}..L{max(lessons(ROOT))}")
    return int(match.group(1))


def pick(tasks: list[Task], number: int | None) -> list[Task]:
    if number is None:
        return tasks
    if not 1 <= number <= len(tasks):
        raise TaskError(f"--task {number}: L{tasks[0].lesson} has tasks 1..{len(tasks)}")
    return [tasks[number - 1]]


def doc_for(lesson: int) -> Path:
    """docs/lN_<name>.md, the lesson's main doc (its name need not be the folder's: l13_structured_output.md)."""
    found = [p for p in (ROOT / "docs").glob(f"l{lesson}_*.md") if not p.stem.endswith("_appendix")]
    if len(found) != 1:
        raise TaskError(f"L{lesson} has {len(found)} main docs under docs/, not one")
    return found[0]


def markdown(lesson: int) -> str:
    """The lesson doc's Tasks section, generated from the markers (tests/test_build_track.py holds the doc to it)."""
    tasks = lesson_tasks(ROOT, lesson)
    total = sum(len(t.tests) for t in tasks)
    below = {1: "the shared model and harness", 2: "L1 complete"}.get(lesson, f"L1..L{lesson - 1} complete")
    intro = (
        f"`python scripts/course.py start L{lesson} --into DIR` copies the course into DIR ({below}) with "
        f"L{lesson}'s task functions stubbed: each keeps its signature and docstring (the shapes) and raises "
        f"`NotImplementedError`. Fill them in, in order, in DIR; `python scripts/course.py check L{lesson}` says "
        f"where you stand: 0 of {len(tasks)} tasks (0 of {total} tests) before you start, {len(tasks)} of "
        f"{len(tasks)} after, then the smoke's parity. `check L{lesson} --task K` runs one task's tests, "
        f"`diff L{lesson}` shows yours beside the reference, `reset L{lesson} --task K` puts a stub back. "
        f"Read this doc in DIR/docs/ while you build: its learner's edition, with each quoted solution replaced by "
        f"its task's contract (what to write, what must hold, what the tests check), and every contract below. "
        f"(This section is generated: `python scripts/course.py tasks L{lesson} --markdown`.)")
    out = [
        "## Tasks: build it yourself",
        "",
        *textwrap.wrap(intro, 110, break_on_hyphens=False, break_long_words=False),
        "",
        "| task | implement | in | tests (0, then all, pass) |",
        "| --- | --- | --- | --- |",
    ]
    for t in tasks:
        functions = "<br>".join(f"`{f.qualname.rsplit('.', 1)[0] + '.' if '.' in f.qualname else ''}{f.signature}`"
                                for f in t.functions)
        files = "<br>".join(sorted({f"`{f.path.split('/', 2)[2]}`" for f in t.functions}))
        cell = f"{t.title}:<br>{functions}".replace("|", "\\|")  # a cell splits at a bare | even inside backticks
        out.append(f"| {t.number} | {cell} | {files} | {len(t.tests)}: `check L{lesson} --task {t.number}` |")
    return "\n".join(out) + "\n"


def cmd_tasks(args) -> int:
    lesson = lesson_number(args.lesson)
    if args.markdown:
        print(markdown(lesson), end="")
        return 0
    for t in lesson_tasks(ROOT, lesson):
        print(f"task {t.number}: {t.title}")
        for f in t.functions:
            print(f"    {f.path}: {f.qualname.rsplit('.', 1)[0] + '.' if '.' in f.qualname else ''}{f.signature}")
        print(f"    tests: {', '.join(t.tests)}")
    return 0


def cmd_start(args) -> int:
    lesson = lesson_number(args.lesson)
    into = Path(args.into).expanduser().resolve()
    tasks = start(ROOT, lesson, into, cache_root())
    print(f"L{lesson}'s workspace: {into} ({len(tasks)} tasks stubbed)")
    for t in tasks:
        print(f"  task {t.number}: {t.title} ({t.names()} in {t.functions[0].path})")
    print(f"read {into / 'docs' / doc_for(lesson).name} (the learner's edition: each task's contract, no solutions); "
          f"edit task 1 in {into}, then `python {Path(__file__).relative_to(ROOT)} check L{lesson}`")
    return 0


# lesson from which on -> (module, its loader, what it is); each module also names KernelUnavailable
KERNELS = {1: ("shared.cpu_ops", "load_ops", "the C++ decode ops"),  # every model's CPU matmul, norms, RoPE; L14's too
           3: ("lessons.l3_block_tensor.backends.cpp_backend", "load_kernel", "L3's C++ attention kernel")}


def build_kernels(workspace: Path, lesson: int, quiet_below: float = 5) -> None:
    """Build (or load) the C++ kernels the lesson's tests use before they run, saying so, since a build takes about a
    minute and `check` would otherwise sit silent. Its own line says when a build starts; this one how long it took."""
    for first, (module, function, name) in KERNELS.items():
        if lesson < first:
            continue
        began = time.monotonic()
        code = (f"import sys\nfrom {module} import {function}, KernelUnavailable\ntry:\n    {function}()\n"
                f"except KernelUnavailable as e:\n"
                f"    print('note:', {name!r}, f'is unavailable ({{e}}); its tests skip', file=sys.stderr)")
        env = {**os.environ, "PYTHONPATH": str(workspace)}
        subprocess.run([sys.executable, "-c", code], cwd=workspace, env=env, stdout=subprocess.DEVNULL, timeout=900)
        seconds = time.monotonic() - began
        if seconds > quiet_below:  # a load of a finished build (a second) needs no word
            print(f"{name}: ready in {seconds:.0f} s (built once per cache folder; later checks load it in a second)",
                  file=sys.stderr, flush=True)


def next_lesson(lesson: int) -> str:
    if lesson == max(lessons(ROOT)):
        return "that was the last lesson: the course is done"
    return (f"next lesson: L{lesson + 1} ({doc_for(lesson + 1).relative_to(ROOT)}): "
            f"`python scripts/course.py start L{lesson + 1} --into DIR`")


def cmd_check(args) -> int:
    lesson = lesson_number(args.lesson)
    workspace = find(lesson, Path(args.workspace) if args.workspace else None, cache_root())
    reference = reference_of(workspace)
    # the tests each task must pass are the reference's: a test file missing from the workspace is noticed
    every = lesson_tasks(reference if (reference / "lessons").is_dir() else workspace, lesson)
    tasks = pick(every, args.task)
    build_kernels(workspace, lesson)
    print(f"running L{lesson}'s task tests in {workspace} ...", file=sys.stderr, flush=True)
    results = run_tests(workspace, lesson, args.task)
    done, next_task, tests_passed, tests_total = 0, None, 0, 0
    for t in tasks:
        mine = [r for r in results if r.task == t.id]
        ran = {r.nodeid.split("[")[0] for r in mine}  # a parametrized test counts once: it passes when all do
        failing = {r.nodeid.split("[")[0] for r in mine if not r.passed}
        missing = [test for test in t.tests if test not in ran]
        ok = bool(mine) and not failing and not missing  # a task none (or not all) of whose tests ran never passes
        done += ok
        tests_passed += len(ran - failing)
        tests_total += len(t.tests)
        if not ok and next_task is None:
            next_task = (t, next((r for r in mine if not r.passed), None))
        print(f"  {'PASS' if ok else 'todo'}  task {t.number}: {t.names()}  {len(ran - failing)} of {len(t.tests)} "
              "tests pass")
        if missing:
            print(f"        could not run (not found in {workspace}): {', '.join(missing)}")
    totals = f"{tests_passed} of {tests_total}"
    if next_task:
        t, failed = next_task
        scope = f"task {args.task} fails" if args.task else f"{done} of {len(tasks)} tasks pass"
        print(f"tests: {totals} pass")
        print(f"L{lesson}: {scope}; next: task {t.number}, {t.names()} ({t.functions[0].path})")
        if failed is not None:
            print(f"  {failed.nodeid}")
            for line in failed.message.splitlines():
                print(f"    {line}")
        return 1
    if args.task:
        after = next((k for k in every if k.number > args.task), None)
        print(f"tests: {totals} pass")
        print(f"L{lesson}: task {args.task} passes; next: " + (
            f"task {after.number}, {after.names()} ({after.functions[0].path}): `check L{lesson} --task {after.number}`"
            if after else f"every task done? `python scripts/course.py check L{lesson}` runs them all and the smoke"))
        return 0
    print(f"tests: {totals} pass")
    print(f"L{lesson}: {done} of {len(tasks)} tasks pass")
    smoke = workspace / "scripts" / f"l{lesson}_smoke.py"
    print(f"running the smoke: python scripts/{smoke.name} ...", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": str(workspace)}  # the workspace's lessons, never the installed course's
    try:
        run = subprocess.run([sys.executable, str(smoke)], cwd=workspace, env=env, capture_output=True, text=True,
                             timeout=1800)
    except subprocess.TimeoutExpired:
        raise TaskError(f"the smoke ran past 30 minutes in {workspace}") from None
    tail = (run.stdout.strip().splitlines() or [""])[-1]
    print(f"the smoke (exit {run.returncode}): {tail}")
    if run.returncode == 0:
        print(f"L{lesson} is built. {next_lesson(lesson)}")
    return 0 if run.returncode == 0 else 1


def cmd_diff(args) -> int:
    lesson = lesson_number(args.lesson)
    workspace = find(lesson, Path(args.workspace) if args.workspace else None, cache_root())
    root = reference_of(workspace)
    for t in pick(lesson_tasks(root, lesson), args.task):
        for f in t.functions:
            try:
                mine = function_source((workspace / f.path).read_text(), f.qualname)
            except SyntaxError as e:
                print(f"task {t.number}, {f.qualname}: your {f.path} does not parse (line {e.lineno}: {e.msg})")
                continue
            if not mine:
                print(f"task {t.number}, {f.qualname}: not in your {f.path} (renamed or deleted?)")
                continue
            reference = function_source((root / f.path).read_text(), f.qualname)
            lines = list(difflib.unified_diff(mine.splitlines(keepends=True), reference.splitlines(keepends=True),
                                              f"yours: {f.path}::{f.qualname}", f"reference: {f.path}::{f.qualname}"))
            print(f"task {t.number}, {f.qualname}: "
                  + ("the same as the reference" if not lines else "yours (-) beside the reference (+):"))
            sys.stdout.writelines(lines)
    return 0


def cmd_reset(args) -> int:
    lesson = lesson_number(args.lesson)
    workspace = find(lesson, Path(args.workspace) if args.workspace else None, cache_root())
    root = reference_of(workspace)
    tasks = pick(lesson_tasks(root, lesson), args.task)
    backup = restore(workspace, root, lesson, {t.number for t in tasks})
    print(f"L{lesson}: the stub of task {', '.join(str(t.number) for t in tasks)} is back in {workspace}; "
          f"your version is kept in {backup}")
    return 0


def cmd_verify(args) -> int:
    problems = []
    for lesson in [lesson_number(x) for x in args.lessons] or lessons(ROOT):
        found, report = [], []
        if args.only in (None, "tasks"):
            found += verify(ROOT, lesson)
        if args.only in (None, "planted"):
            planted_problems, report = verify_planted(ROOT, lesson, doc_for(lesson))
            found += planted_problems
        print(f"L{lesson}: {'holds' if not found else f'{len(found)} problem(s)'}"
              + (f"; {len(report)} planted bugs caught" if report else ""), flush=True)
        for line in report:
            print(f"  caught: {line}")
        problems += found
        for p in found:
            print(f"  {p}")
    return 1 if problems else 0


def main() -> int:
    p = OneLineParser(prog="course.py", description=__doc__.split("\n")[0],
                      epilog="the commands' options: start --into DIR; check, diff: --task K, --in DIR; reset --task K "
                             "[--in DIR]; tasks --markdown. `course.py COMMAND --help` says more.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("tasks", "list a lesson's tasks"), ("start", "make a workspace"),
                           ("check", "run the task tests in the workspace"), ("diff", "yours beside the reference"),
                           ("reset", "put stubs back"), ("verify", "maintainers: hold every task to its promise")):
        s = sub.add_parser(name, help=helptext)
        if name == "verify":
            s.add_argument("lessons", nargs="*", help="L2 L3 ... (default: every lesson)")
            s.add_argument("--only", choices=("tasks", "planted"),
                           help="tasks: each task fails stubbed and passes filled in; planted: each pitfall's and "
                                "exercise's mutation fails its task (default: both)")
            continue
        s.add_argument("lesson", help="L1 .. L14")
        if name == "tasks":
            s.add_argument("--markdown", action="store_true", help="the doc's Tasks section")
        if name == "start":
            s.add_argument("--into", required=True, help="a new folder outside the course for your workspace")
        if name in ("check", "diff", "reset"):
            s.add_argument("--task", type=int, required=name == "reset", help="one task's number")
            s.add_argument("--in", dest="workspace", help="the workspace (default: the one you are in, or the last "
                                                          "one started for the lesson)")
    args = p.parse_args()
    try:
        return globals()[f"cmd_{args.command}"](args)
    except TaskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

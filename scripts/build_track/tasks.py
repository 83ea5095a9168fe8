"""The build track's tasks, read from the reference code itself, so the solution is the lesson and cannot drift.

A comment line `# Task L2.3: what to build` directly above a function (above its decorators, if any) in lesson 2's
folder marks that function as part of task 3 of L2; several functions may carry the same task. A test joins a
task with `@pytest.mark.task("L2.3")`. In a learner's workspace every marked function keeps its signature and
docstring (the shapes live there) and its body becomes one `raise NotImplementedError(...)` naming the task.
"""
from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

MARKER = re.compile(r"^\s*# Task L(\d+)\.(\d+): (.+?)\s*$")
TEST_MARK = re.compile(r"""pytest\.mark\.task\(\s*["']L(\d+)\.(\d+)["']\s*\)""")
LESSON_FOLDER = re.compile(r"^l(\d+)_\w+$")


class TaskError(Exception):
    """A marker, a test mark or a stub that does not fit; the message says where, in one line."""


@dataclass(frozen=True)
class TaskFunction:
    path: str  # relative to the root, posix
    qualname: str  # Class.method or function
    signature: str  # name(parameters) -> return


@dataclass
class Task:
    lesson: int
    number: int
    title: str
    functions: list[TaskFunction] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)  # pytest node ids, tests/file.py::test_name

    @property
    def id(self) -> str:
        return f"L{self.lesson}.{self.number}"

    def names(self) -> str:
        return ", ".join(f"`{f.qualname}`" for f in self.functions)

    def stub_message(self) -> str:
        return f"L{self.lesson} task {self.number} ({', '.join(f.qualname for f in self.functions)}): {self.title}"


def lesson_folder(root: Path, lesson: int) -> Path:
    found = [p for p in (root / "lessons").glob(f"l{lesson}_*") if p.is_dir()]
    if len(found) != 1:
        raise TaskError(f"no lesson L{lesson} under {root / 'lessons'}")
    return found[0]


def lessons(root: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in (root / "lessons").iterdir() if (m := LESSON_FOLDER.match(p.name)))


def _functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualname, node) of every function and method, nested ones included."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(tree, "")
    return found


@functools.lru_cache(maxsize=512)
def marked_functions(text: str) -> list[tuple[int, int, str, str, ast.FunctionDef]]:
    """(lesson, task, title, qualname, node) for each function of `text` with a task marker above it (cached: the
    build track reads each file many times; nothing changes the nodes)."""
    lines = text.splitlines()
    marked = []
    for qualname, node in _functions(ast.parse(text)):
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        match = MARKER.match(lines[first - 2]) if first >= 2 else None
        if match:
            marked.append((int(match.group(1)), int(match.group(2)), match.group(3), qualname, node))
    return marked


def _signature(node: ast.FunctionDef) -> str:
    """name(parameters) -> return, as ast writes them (defaults and annotations included)."""
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{node.name}({ast.unparse(node.args)}){returns}"


def lesson_tasks(root: Path, lesson: int) -> list[Task]:
    """Lesson `lesson`'s tasks in order, with their functions and their tests. Raises TaskError on a marker for
    another lesson, numbers that skip, or a test mark naming a task that does not exist."""
    folder = lesson_folder(root, lesson)
    tasks: dict[int, Task] = {}
    for path in sorted(folder.rglob("*.py")):
        text, rel = path.read_text(), path.relative_to(root).as_posix()
        try:
            marked = marked_functions(text)
        except SyntaxError as e:
            raise TaskError(f"{rel}, line {e.lineno}: {e.msg}") from None
        for marked_lesson, number, title, qualname, node in marked:
            if marked_lesson != lesson:
                raise TaskError(f"{rel}: `{qualname}` is marked L{marked_lesson}.{number} in L{lesson}'s folder")
            task = tasks.setdefault(number, Task(lesson, number, title))
            if task.title != title:
                raise TaskError(f"{rel}: `{qualname}` gives task {task.id} a second title")
            task.functions.append(TaskFunction(rel, qualname, _signature(node)))
    if sorted(tasks) != list(range(1, len(tasks) + 1)):
        raise TaskError(f"L{lesson}'s tasks are numbered {sorted(tasks)}, not 1..{len(tasks)}")
    for test_file in sorted((root / "tests").glob("test_*.py")):
        for test_lesson, number, name in marked_tests(test_file.read_text()):
            if test_lesson != lesson:
                continue
            if number not in tasks:
                raise TaskError(f"{test_file.name}::{name} is marked L{lesson}.{number}, a task L{lesson} lacks")
            tasks[number].tests.append(f"tests/{test_file.name}::{name}")
    return [tasks[n] for n in sorted(tasks)]


@functools.lru_cache(maxsize=512)
def marked_tests(text: str) -> list[tuple[int, int, str]]:
    """(lesson, task, test name) for each test function of a test file with a `pytest.mark.task` decorator."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                if match := TEST_MARK.search(ast.unparse(decorator)):
                    found.append((int(match.group(1)), int(match.group(2)), node.name))
    return found


def stub_text(text: str, task_numbers: set[int] | None = None, lesson: int | None = None) -> str:
    """`text` with the body of every marked function (of the given tasks, or all) replaced by a raise that names
    its task; signature, decorators, marker and docstring kept."""
    lines = text.splitlines(keepends=True)
    cuts = []
    titles: dict[int, tuple[str, list[str]]] = {}
    marked = marked_functions(text)
    for marked_lesson, number, title, qualname, node in marked:
        titles.setdefault(number, (title, []))[1].append(qualname)
    for marked_lesson, number, title, qualname, node in marked:
        if (task_numbers is not None and number not in task_numbers) or (lesson not in (None, marked_lesson)):
            continue
        body = node.body
        has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str)
        start = body[0].end_lineno + 1 if has_doc else body[0].lineno
        if body[0].lineno == node.lineno:
            raise TaskError(f"`{qualname}` has its body on its def line: put it on lines of its own")
        indent = re.match(r"\s*", lines[body[0].lineno - 1]).group(0)
        names = ", ".join(titles[number][1])
        message = f"L{marked_lesson} task {number} ({names}): {title}"
        cuts.append((start, node.end_lineno, f"{indent}raise NotImplementedError({message!r})\n"))
    for start, end, stub in sorted(cuts, reverse=True):  # from the bottom, so earlier line numbers hold
        lines[start - 1 : end] = [stub]
    return "".join(lines)


def function_source(text: str, qualname: str) -> str:
    """A function's source as written in `text` (decorators and body), for diffs; empty if it is not there."""
    lines = text.splitlines(keepends=True)
    for name, node in _functions(ast.parse(text)):
        if name == qualname:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return "".join(lines[first - 1 : node.end_lineno])
    return ""

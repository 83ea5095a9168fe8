"""A lesson doc's learner's edition: the same text, with every quoted body of a task function replaced by the task's
contract, so that a learner who reads the doc beside a workspace meets what to build, not how it was built.

A quote (`<!-- quote: path:START-END -->` and its fenced block) keeps its lines outside the lesson's task bodies
(signatures, docstrings, fields); each task body inside it becomes `...  # task LN.K: yours`, and the block is
followed by the contract of each task it touched: the functions and their docstrings' first lines, the exceptions
and messages the reference raises (with `{...}` for the values), what its tests check (their names), and mistakes
to watch for (the mutations scripts/checks/mutations.py plants in that task's code). A fenced block without a quote marker
that holds a line of a task body (a sketch) is replaced by a pointer to the contract.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from build_track.planted import mutations, owner
from build_track.tasks import Task, lesson_tasks, marked_functions

QUOTE = re.compile(r"^<!-- quote: (\S+?):(\d+)-(\d+) -->\n```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
TASKS = "\n## Tasks: build it yourself"
DOC_LESSON = re.compile(r"^l(\d+)_")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def code_of(line: str) -> str:
    """A line of code as compared: its trailing comment dropped, its whitespace normalized."""
    return " ".join(line.split("  #")[0].split())


def body_ranges(root: Path, lesson: int) -> dict[str, list[tuple[int, int, int]]]:
    """path -> [(first, last, task)] line ranges (1-based, inclusive) of each task function's body, docstring left
    out: the lines a learner writes."""
    ranges: dict[str, list[tuple[int, int, int]]] = {}
    for task in lesson_tasks(root, lesson):
        for fn in task.functions:
            text = (root / fn.path).read_text()
            for marked_lesson, number, _title, qualname, node in marked_functions(text):
                if qualname != fn.qualname or marked_lesson != lesson:
                    continue
                body = node.body
                has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str)
                first = body[0].end_lineno + 1 if has_doc else body[0].lineno
                ranges.setdefault(fn.path, []).append((first, node.end_lineno, number))
    return ranges


def body_lines(root: Path, lesson: int) -> dict[str, int]:
    """Every line a learner writes for `lesson`'s tasks, normalized, that says something of its own (not `else:`,
    `return out`, a bracket) and that the workspace's finished code (the lessons below, shared/) does not already
    hold: {line: task}. What no learner's-edition doc may show."""
    below = [f for f in (root / "lessons").iterdir() if (m := DOC_LESSON.match(f.name)) and int(m.group(1)) < lesson]
    given = {code_of(line) for folder in [root / "shared", *below] for path in folder.rglob("*.py")
             for line in path.read_text().splitlines()}
    found = {}
    for path, spans in body_ranges(root, lesson).items():
        lines = (root / path).read_text().splitlines()
        for first, last, task in spans:
            for line in lines[first - 1 : last]:
                code = code_of(line)
                if len(code) >= 16 and not code.startswith("#") and code not in given:
                    found.setdefault(code, task)
    return found


def _message(node: ast.AST) -> str:
    """An exception's message as a learner needs it: the literal text, `{...}` where a value goes."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{...}" for v in node.values)
    return "..."


def raises(root: Path, task: Task) -> list[str]:
    """`ValueError("block {...} is not in this pool (0..{...})")` for each raise in the task's reference bodies."""
    found = []
    for fn in task.functions:
        text = (root / fn.path).read_text()
        for _lesson, _number, _title, qualname, node in marked_functions(text):
            if qualname != fn.qualname:
                continue
            for r in ast.walk(node):
                if isinstance(r, ast.Raise) and isinstance(r.exc, ast.Call):
                    name = ast.unparse(r.exc.func)
                    args = [f'"{_message(a)}"' for a in r.exc.args] + [f"{k.arg}=..." for k in r.exc.keywords]
                    found.append(f"`{name}({', '.join(args)})`")
    return list(dict.fromkeys(found))


def _docstring_head(root: Path, path: str, qualname: str) -> str:
    for _lesson, _number, _title, name, node in marked_functions((root / path).read_text()):
        if name == qualname:
            doc = ast.get_docstring(node) or ""
            return " ".join(doc.split("\n\n")[0].split())
    return ""


@functools.lru_cache(maxsize=4)
def _owned_mutations(root: Path) -> dict[tuple[int, int], list[str]]:
    """(lesson, task) -> the descriptions of the mutations planted in that task's code alone."""
    owned: dict[tuple[int, int], list[str]] = {}
    for m in mutations()[0].values():
        owners = {owner(root, f, old) for f, old, _new in m.edits()}
        if len(owners) == 1 and None not in owners:
            owned.setdefault(owners.pop(), []).append(m.description)
    return owned


def _fields_built(root: Path, path: str, qualname: str) -> list[str]:
    """For a method that returns its own class (`BatchMeta.build -> "BatchMeta"`): the class's annotated fields with
    their comments (shape, dtype, device), which are what the method must fill."""
    if "." not in qualname:
        return []
    cls_name, method = qualname.rsplit(".", 1)
    lines = (root / path).read_text().splitlines()
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.ClassDef) and node.name == cls_name.split(".")[-1]:
            fn = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
            if fn is None or fn.returns is None or cls_name.split(".")[-1] not in ast.unparse(fn.returns):
                return []
            return [f"`{' '.join(lines[n.lineno - 1].split())}`" for n in node.body if isinstance(n, ast.AnnAssign)]
    return []


def _known_mistakes(root: Path, task: Task) -> list[str]:
    return _owned_mutations(root).get((task.lesson, task.number), [])


def contract(root: Path, task: Task) -> str:
    """Task `task`'s contract, in markdown: what to write, what must hold, what its tests check."""
    files = ", ".join(sorted({f"`{f.path}`" for f in task.functions}))
    out = [f"> **Task {task.id}, yours to write: {task.title}.** In {files}; "
           f"`python scripts/course.py check L{task.lesson} --task {task.number}` runs its "
           f"{len(task.tests)} test{'s' if len(task.tests) != 1 else ''}.", ">"]
    for f in task.functions:
        head = _docstring_head(root, f.path, f.qualname)
        owner_class = f.qualname.rsplit(".", 1)[0] + "." if "." in f.qualname else ""
        out.append(f"> - `{owner_class}{f.signature}`" + (f": {head}" if head else ""))
        if fields := _fields_built(root, f.path, f.qualname):
            out.append(f">   fills: {'; '.join(fields)}")
    if said := raises(root, task):
        out.append(f"> - raises, as the tests expect: {'; '.join(said)}")
    names = [t.split("::")[-1].removeprefix("test_").replace("_", " ") for t in task.tests]
    out.append("> - its tests check: " + "; ".join(dict.fromkeys(names)))
    if mistakes := _known_mistakes(root, task):
        out.append("> - mistakes to watch for (hints; each is planted by the course's mutation check): "
                   + "; ".join(mistakes[:4]))
    return "\n".join(out)


def learners_edition(root: Path, lesson: int, text: str) -> str:
    """`text` (a doc of lesson `lesson`, or its appendix) with every task body it shows replaced by its contract."""
    tasks = {t.number: t for t in lesson_tasks(root, lesson)}
    spans = body_ranges(root, lesson)
    hidden = body_lines(root, lesson)

    def quoted(m: re.Match) -> str:
        path, start, end, lang, _body = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4), m.group(5)
        touched = [(a, b, k) for a, b, k in spans.get(path, []) if a <= end and b >= start]
        if not touched:
            return m.group(0)
        lines = (root / path).read_text().splitlines()
        shown, numbers = [], []
        for n in range(start, end + 1):
            inside = next(((a, k) for a, b, k in touched if a <= n <= b), None)
            if inside is None:
                shown.append(lines[n - 1])
            elif n == max(inside[0], start):
                indent = re.match(r"\s*", lines[n - 1]).group(0)
                shown.append(f"{indent}...  # task L{lesson}.{inside[1]}: yours")
                numbers.append(inside[1])
        block = f"```{lang}\n" + "\n".join(shown) + "\n```"
        return block + "\n\n" + "\n\n".join(contract(root, tasks[k]) for k in dict.fromkeys(numbers))

    text = QUOTE.sub(quoted, text)

    def sketch(m: re.Match) -> str:
        leaked = sorted({hidden[c] for line in m.group(2).splitlines() if (c := code_of(line))
                         in hidden})
        if not leaked:
            return m.group(0)
        return "\n\n".join(contract(root, tasks[k]) for k in leaked)

    text = FENCE.sub(sketch, text)
    if (at := text.find(TASKS)) >= 0:  # the main doc: every contract at the end of its Tasks section
        end = text.find("\n## ", at + 1)
        end = len(text) if end < 0 else end
        every = "\n\n".join(contract(root, t) for t in tasks.values())
        text = text[:end].rstrip("\n") + "\n\n### Every task's contract\n\n" + every + "\n" + text[end:]
    return text

"""Each lesson builds only on the lessons before it: lessons/lN_* imports `lessons.lM_*` with M <= N (its own
folder included), `shared`, the standard library and third-party packages; never a later lesson, never
scripts/ or tests/. shared/ imports no lesson at all.

Every import counts, wherever it is: at the top, inside a function (a lazy import), relative
(`from .runner import ...`), `importlib.import_module("lessons....")` or `__import__` with a literal name, and a
string constant that is a module path under lessons. ("lessons.l12_kv_quant.runner" or "...runner:quantized"),
the form a dynamic import is handed. A failure names the file, the line and the import.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSON = re.compile(r"^l(\d+)_\w+$")
MODULE_PATH = re.compile(r"^lessons(?:\.\w+)+(?::[\w.]+)?$")  # a string naming a module under lessons.
DYNAMIC = {"import_module", "__import__"}


def lesson_number(part: str) -> int | None:
    match = LESSON.match(part)
    return int(match.group(1)) if match else None


def module_of(path: Path) -> list[str]:
    """A file's dotted module name as parts: lessons/l10_x/runner.py -> [lessons, l10_x, runner]."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_names(tree: ast.AST, path: Path) -> list[tuple[int, str, str]]:
    """(line, module imported, how it reads in the source) for every import the file makes, anywhere in it."""
    package = module_of(path) if path.name == "__init__.py" else module_of(path)[:-1]
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, f"import {a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            text = f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}"
            found.append((node.lineno, module, text))
            if module in ("lessons", "shared") or not node.module:  # `from lessons import l12_kv_quant`
                found += [(node.lineno, f"{module}.{a.name}", text) for a in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in DYNAMIC and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value, f"{name}({node.args[0].value!r})"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.match(node.value):
            found.append((node.lineno, node.value.partition(":")[0], f"the string {node.value!r}"))
    seen: set[tuple[int, str]] = set()  # import_module("lessons...")'s string is found twice: once is enough
    return [f for f in found if (f[0], f[1]) not in seen and not seen.add((f[0], f[1]))]


def local_top_levels() -> set[str]:
    """Names that would import this repository's scripts/ or tests/ (tests import each other by bare name)."""
    names = {"scripts", "tests"}
    for folder in ("scripts", "tests"):
        names |= {p.stem for p in (ROOT / folder).glob("*.py")} | {p.name for p in (ROOT / folder).iterdir()
                                                                     if p.is_dir() and p.name != "__pycache__"}
    return names - set(sys.stdlib_module_names)


def violations(path: Path, source: str | None = None) -> list[str]:
    """What `path` (lessons/lN_*/... or shared/...) imports that it may not, one line each."""
    rel = path.relative_to(ROOT)
    own = lesson_number(rel.parts[1]) if rel.parts[0] == "lessons" and len(rel.parts) > 2 else None
    tree = ast.parse(path.read_text() if source is None else source, filename=str(rel))
    local, bad = local_top_levels(), []
    for line, module, text in imported_names(tree, path):
        parts = module.split(".")
        if parts[0] in local:
            why = "scripts/ and tests/ are not the course's code"
        elif parts[0] != "lessons":
            continue  # shared, the standard library, a third-party package
        elif rel.parts[0] == "shared":
            why = "shared/ imports no lesson"
        elif len(parts) < 2:
            continue  # `from lessons import x` is checked as lessons.x
        elif (theirs := lesson_number(parts[1])) is None or own is None:
            why = "not a lesson folder" if theirs is None else "lessons/ itself imports no lesson"
        elif theirs > own:
            why = f"L{own} may not use the later L{theirs}"
        else:
            continue
        bad.append(f"{rel}:{line}: {text} ({why})")
    return bad


def course_files() -> list[Path]:
    return sorted(p for folder in ("lessons", "shared") for p in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_every_lesson_imports_only_earlier_lessons_and_shared_imports_none():
    files = course_files()
    assert len([p for p in files if p.parts[len(ROOT.parts)] == "lessons"]) > 50, "the lessons were not found"
    bad = [line for p in files for line in violations(p)]
    assert not bad, "imports that break the lesson order:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, says", [
    ("from lessons.l12_kv_quant.runner import quantized\n", "from lessons.l12_kv_quant.runner import quantized"),
    ("def f():\n    import lessons.l11_speculative.engine\n", "import lessons.l11_speculative.engine"),  # lazy
    ("import importlib\nimportlib.import_module('lessons.l13_structured.engine')\n", "import_module("),
    ("__import__('lessons.l12_kv_quant')\n", "__import__("),
    ("PATH = 'lessons.l12_kv_quant.runner:quantized'\n", "the string 'lessons.l12_kv_quant.runner:quantized'"),
    ("from lessons import l11_speculative\n", "from lessons import l11_speculative"),
    ("from .. import l12_kv_quant\n", "from .. import l12_kv_quant"),
    ("from ..l12_kv_quant import runner\n", "from ..l12_kv_quant import runner"),  # relative: lessons.l12_kv_quant
    ("from scripts.checks import mutations\n", "scripts/ and tests/"),
    ("from fake_runner import FakeRunner\n", "scripts/ and tests/"),  # a tests/ module by its bare name
])
def test_the_check_catches_every_form_of_import(source, says):
    """Planted in L10's follower (a file the walk reads): each form of reaching a later lesson is named."""
    path = ROOT / "lessons/l10_tensor_parallel/follower.py"
    [line] = violations(path, source)
    assert line.startswith("lessons/l10_tensor_parallel/follower.py:") and says in line, line


def test_the_check_allows_earlier_lessons_its_own_shared_and_packages():
    source = ("import torch\nimport importlib\nfrom lessons.l8_chunked_prefill.slice import Slice\n"
              "from .runner import TpRunner\nfrom shared.errors import RunFailure\n"
              "def f(name):\n    return importlib.import_module(name)\nX = 'lessons.l10_tensor_parallel.runner:TpRunner'\n")
    assert violations(ROOT / "lessons/l10_tensor_parallel/follower.py", source) == []
    assert violations(ROOT / "shared/model.py", "from lessons.l1_contiguous import engine\n") == [
        "shared/model.py:1: from lessons.l1_contiguous import engine (shared/ imports no lesson)"]

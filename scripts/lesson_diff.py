"""Print what really changed between two lessons, read from the code as it is now.

    python scripts/lesson_diff.py L1 L2        # any two lessons, usually adjacent
    python scripts/lesson_diff.py --list       # every lesson's roles and where each is defined

Each lesson's __init__.py names the functions that carry its ideas in a `ROLES` mapping, role ->
"file.py::Class.function" inside its folder ("kv seam", "engine loop", "admission", ...). For every role the
newer lesson defines, this diffs it against the latest definition of the same role at or before the older
lesson (walking back, since a lesson that changes nothing in a role imports it); a role no earlier lesson
had is printed whole as new. Roles the newer lesson does not define are listed as inherited.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.cli import OneLineParser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def lessons() -> list[Path]:
    return sorted((p for p in (ROOT / "lessons").glob("l*_*/") if p.name[1:].split("_")[0].isdigit()),
                  key=lambda p: int(p.name[1:].split("_")[0]))


def lesson_index(name: str, folders: list[Path]) -> int:
    number = name.lower().removeprefix("l")
    for i, folder in enumerate(folders):
        if number.isdigit() and folder.name.startswith(f"l{int(number)}_"):
            return i
    fail(f"no lesson folder for {name!r} (lessons here: {', '.join('L' + f.name[1:].split('_')[0] for f in folders)})")


def roles(folder: Path) -> dict[str, str]:
    """The ROLES literal of the lesson's __init__.py, read without importing the lesson (no torch needed)."""
    tree = ast.parse((folder / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ROLES" for t in node.targets):
            return ast.literal_eval(node.value)
    fail(f"{folder.relative_to(ROOT)}/__init__.py defines no ROLES mapping")


def source(folder: Path, where: str) -> tuple[str, list[str]]:
    """("path:start-end", lines) of "file.py::Class.function" (or "file.py::function") in the folder."""
    file, _, qualname = where.partition("::")
    path = folder / file
    if not path.is_file():
        fail(f"{folder.name} ROLES names {file}, which does not exist")
    text = path.read_text()
    scope: list[ast.stmt] = ast.parse(text).body
    node = None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part), None)
        if node is None:
            fail(f"{folder.name} ROLES names {where}, but {file} has no {part}")
        scope = node.body
    lines = text.splitlines()[node.lineno - 1 : node.end_lineno]
    return f"{path.relative_to(ROOT)}:{node.lineno}-{node.end_lineno}", lines


def diff(old: int, new: int, folders: list[Path]) -> str:
    out = []
    for role, where in roles(folders[new]).items():
        new_src = source(folders[new], where)
        before = next((i for i in range(old, -1, -1) if role in roles(folders[i])), None)
        if before is None:
            out.append(f"# {role}: new in {folders[new].name} ({new_src[0]})")
            out.append("\n".join("+" + line for line in new_src[1]))
            continue
        old_src = source(folders[before], roles(folders[before])[role])
        lines = difflib.unified_diff(old_src[1], new_src[1], fromfile=old_src[0], tofile=new_src[0], lineterm="", n=20)
        out.append(f"# {role}")
        out.append("\n".join(lines) or f"(identical to {old_src[0]})")
    inherited = [r for i in range(old + 1) for r in roles(folders[i]) if r not in roles(folders[new])]
    if inherited:
        out.append(f"# unchanged in {folders[new].name}, imported from earlier lessons: {', '.join(dict.fromkeys(inherited))}")
    return "\n\n".join(out) + "\n"


def main() -> int:
    p = OneLineParser(prog="lesson_diff.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", nargs="?", help="earlier lesson, e.g. L1")
    p.add_argument("new", nargs="?", help="later lesson, e.g. L2")
    p.add_argument("--list", action="store_true", help="print every lesson's roles and where each is defined")
    args = p.parse_args()
    folders = lessons()
    if args.list:
        for folder in folders:
            for role, where in roles(folder).items():
                print(f"{folder.name:20} {role:18} {source(folder, where)[0]}")
        return 0
    if args.old is None or args.new is None:
        p.error("name two lessons, e.g. L1 L2 (or --list)")
    old, new = lesson_index(args.old, folders), lesson_index(args.new, folders)
    if old >= new:
        fail(f"{args.old} is not earlier than {args.new}")
    print(diff(old, new, folders), end="")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into `head`: stop quietly
        sys.stderr.close()

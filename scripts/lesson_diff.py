"""Print the real diff between two lessons' `attend` (the KV seam) and `generate` (the engine loop).

    python scripts/lesson_diff.py L1 L2

Each function is read from the lesson's own folder (the first file, in path order, that defines it), so
what this prints is the code as it is now, never a copy.
"""
import argparse
import ast
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FUNCTIONS = ("attend", "generate")


def lesson_dir(name: str) -> Path:
    prefix = name.lower().removeprefix("l")
    found = sorted(ROOT.glob(f"lessons/l{prefix}_*/")) if prefix.isdigit() else []
    if not found:
        print(f"error: no lesson folder for {name!r} (try L1, L2, ...)", file=sys.stderr)
        raise SystemExit(2)
    return found[0]


def find_function(folder: Path, func: str) -> tuple[str, list[str]] | None:
    """(path:start-end, source lines) of the first method or function named `func` in the folder."""
    for path in sorted(folder.rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name == func:
                lines = text.splitlines()[node.lineno - 1 : node.end_lineno]
                return f"{path.relative_to(ROOT)}:{node.lineno}-{node.end_lineno}", lines
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", help="earlier lesson, e.g. L1")
    p.add_argument("new", help="later lesson, e.g. L2")
    args = p.parse_args()
    old_dir, new_dir = lesson_dir(args.old), lesson_dir(args.new)
    for func in FUNCTIONS:
        old, new = find_function(old_dir, func), find_function(new_dir, func)
        if old is None or new is None:
            missing = old_dir if old is None else new_dir
            print(f"# {func}: not defined under {missing.relative_to(ROOT)}\n")
            continue
        diff = difflib.unified_diff(old[1], new[1], fromfile=old[0], tofile=new[0], lineterm="", n=20)
        print("\n".join(diff) or f"# {func}: identical", end="\n\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into `head`: stop quietly
        sys.stderr.close()

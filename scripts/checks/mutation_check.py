"""Planted-bug check: apply each realistic learner bug (scripts/checks/mutations.py) to a temporary copy of the
working tree, run the behavioural tests expected to catch it, and print the catch rate.

    OMP_NUM_THREADS=1 python scripts/checks/mutation_check.py --jobs 2

Not part of CI (slow). Exit 0 only if every mutation is caught, 1 otherwise, 2 for bad options.
Caught = pytest exit 1 (a test failed); survived = exit 0; anything else (usage/collection error,
timeout, a snippet not found exactly once) = error.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "checks"))

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from mutations import MUTATIONS, Mutation, plant  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402

FAILED = re.compile(r"^FAILED (\S+?)(?: - .*)?$", re.M)


@dataclass
class Result:
    id: str
    area: str
    description: str
    result: str  # caught | survived | error
    seconds: float
    detail: str  # the failing test, or why it is an error


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in files:
        if not rel or rel.startswith(".venv/") or "__pycache__" in rel:
            continue
        src = ROOT / rel
        if not src.is_file():  # deleted in the work tree but still in the index
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def pytest_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run_pytest(copy: Path, args: list[str], timeout: float) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    try:
        p = subprocess.run(cmd, cwd=copy, env=pytest_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout:.0f}s"
    return p.returncode, p.stdout + p.stderr


def check_one(copy: Path, m: Mutation, timeout: float) -> Result:
    t0 = time.monotonic()

    def done(result: str, detail: str) -> Result:
        return Result(m.id, m.area, m.description, result, time.monotonic() - t0, detail)

    if any("test_docs" in a for a in m.tests):
        return done("error", "selector uses tests/test_docs.py (not behavioural)")
    try:
        originals = plant(m, copy)
    except ValueError as e:
        return done("error", str(e))
    try:
        code, out = run_pytest(copy, list(m.tests), timeout)
    finally:
        for path, text in originals.items():
            path.write_text(text)
    if code == 1:
        hit = FAILED.search(out)
        return done("caught", hit.group(1) if hit else "a test failed")
    if code == 0:
        return done("survived", " ".join(m.tests))
    if code is None:
        return done("error", out)
    tail = [line for line in out.strip().splitlines() if line.strip()][-1:] or [""]
    return done("error", f"pytest exit {code}: {tail[0][:100]}")


def baseline(copy: Path, mutations: list[Mutation], timeout: float) -> tuple[bool, str]:
    """Every distinct selector set must pass unmutated, or every mutation would look caught."""
    sets = sorted({m.tests for m in mutations})
    for args in sets:
        code, out = run_pytest(copy, list(args), timeout)
        if code != 0:
            hit = FAILED.search(out or "")
            why = hit.group(1) if hit else (out.strip().splitlines() or ["?"])[-1]
            return False, f"{' '.join(args)} -> exit {code}: {why}"
    return True, f"{len(sets)} selector set(s) pass"


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="mutation_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="parallel temp copies (default 1)")
    p.add_argument("--only", help="comma-separated mutation ids")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--timeout", type=float, default=300, help="seconds per pytest run (default 300)")
    p.add_argument("--json", dest="json_path", help="also write the results to this file")
    p.add_argument("--skip-baseline", action="store_true", help="do not check the unmutated selectors first")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.timeout <= 0:
        p.error(f"--timeout must be positive, got {args.timeout}")
    ids = [m.id for m in MUTATIONS]
    if len(set(ids)) != len(ids):
        p.error("duplicate mutation ids in scripts/checks/mutations.py")
    selected = MUTATIONS
    if args.only:
        want = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = [w for w in want if w not in ids]
        if unknown or not want:
            p.error(f"unknown mutation id(s): {', '.join(unknown) or '(none given)'}")
        selected = [m for m in MUTATIONS if m.id in want]

    console = Console()
    if args.list:
        t = Table(title=f"{len(selected)} mutations")
        for col in ("id", "area", "file", "description", "tests"):
            t.add_column(col)
        for m in selected:
            t.add_row(m.id, m.area, m.file, m.description, " ".join(m.tests))
        console.print(t)
        return 0

    start = time.monotonic()
    jobs = min(args.jobs, len(selected))
    tmp = Path(tempfile.mkdtemp(prefix="mutation_check_"))
    try:
        copies = []
        for j in range(jobs):
            c = tmp / f"copy{j}"
            c.mkdir()
            copy_tree(c)
            copies.append(c)
        if not args.skip_baseline:
            with console.status("baseline: running every selector set on the unmutated copy"):
                ok, why = baseline(copies[0], selected, args.timeout)
            if not ok:
                console.print(f"[red]baseline is red[/red]: {why}")
                console.print("every mutation would look caught; fix the baseline first")
                return 1
            console.print(f"baseline green: {why}")

        todo: queue.Queue[Mutation] = queue.Queue()
        for m in selected:
            todo.put(m)
        results: dict[str, Result] = {}
        lock = threading.Lock()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            task = progress.add_task("mutations", total=len(selected))

            def worker(copy: Path) -> None:
                while True:
                    try:
                        m = todo.get_nowait()
                    except queue.Empty:
                        return
                    r = check_one(copy, m, args.timeout)
                    with lock:
                        results[m.id] = r
                        progress.console.print(f"{r.result:8s} {r.id} ({r.seconds:.0f}s) {r.detail}")
                        progress.advance(task)

            threads = [threading.Thread(target=worker, args=(c,)) for c in copies]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    ordered = [results[m.id] for m in selected]
    table = Table(title="planted bugs")
    for col in ("id", "area", "description", "result", "s", "caught by / why"):
        table.add_column(col, overflow="fold")
    style = {"caught": "green", "survived": "red", "error": "yellow"}
    for r in ordered:
        table.add_row(r.id, r.area, r.description, f"[{style[r.result]}]{r.result}[/]", f"{r.seconds:.0f}", r.detail)
    console.print(table)
    caught = sum(r.result == "caught" for r in ordered)
    survived = [r.id for r in ordered if r.result == "survived"]
    errors = [r.id for r in ordered if r.result == "error"]
    wall = time.monotonic() - start
    console.print(f"caught {caught} of {len(ordered)} ({100 * caught / len(ordered):.0f}%) in {wall:.0f}s"
                  + (f"; survived: {', '.join(survived)}" if survived else "")
                  + (f"; errors: {', '.join(errors)}" if errors else ""))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"caught": caught, "total": len(ordered), "wall_s": round(wall, 1),
                                                    "results": [r.__dict__ for r in ordered]}, indent=2))
    return 0 if caught == len(ordered) else 1


if __name__ == "__main__":
    raise SystemExit(main())

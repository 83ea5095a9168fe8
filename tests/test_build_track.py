"""The build track (scripts/course.py, scripts/build_track/): every lesson has 3 to 8 tasks, each with tests; a stub
keeps the signature and docstring and raises naming its task; a workspace starts with every task failing, passes
task by task as the reference bodies go in, and takes a stub back; each lesson doc holds its generated Tasks section.
A workspace's scripts run the workspace's code: each puts its own tree first on sys.path, and a smoke run there
fails on the stubs and names the lessons/ it imported.
The slow test holds every task of every lesson to its promise (`course.py verify`): with tasks 1..k filled in and
the rest stubbed, the tests of tasks 1..k pass and every later task's fail, for every k.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]
from build_track.tasks import TaskError, function_source, lesson_tasks, lessons, stub_text  # noqa: E402
from build_track.workspace import start  # noqa: E402

COURSE = [sys.executable, str(ROOT / "scripts" / "course.py")]
LESSONS = lessons(ROOT)


def course(*args: str, cwd: Path = ROOT, cache: Path | None = None) -> subprocess.CompletedProcess:
    """scripts/course.py in a subprocess; `cache`: a cache folder of its own (the workspaces it remembers), whose
    kernel builds and tiny model are the suite's own, linked: a fresh kernel build is a minute a test on a 2-core box
    (how `check` builds is test_check_says_when_a_kernel_build_starts_and_how_long_it_took's)."""
    env = None
    if cache is not None:
        from shared.tiny_qwen3 import cache_root, default_model_dir

        cache.mkdir(parents=True, exist_ok=True)
        for shared in (cache_root() / "kernels", default_model_dir()):
            if shared.exists() and not (cache / shared.name).exists():
                (cache / shared.name).symlink_to(shared, target_is_directory=True)
        env = {**os.environ, "PAGED_COURSE_CACHE": str(cache)}
    return subprocess.run([*COURSE, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda n: f"L{n}")
def test_every_lesson_has_3_to_8_tasks_each_with_tests(lesson):
    tasks = lesson_tasks(ROOT, lesson)
    assert 3 <= len(tasks) <= 8, f"L{lesson} has {len(tasks)} tasks; the build track wants 3 to 8"
    for t in tasks:
        assert t.tests, f"{t.id} ({t.names()}) has no test marked @pytest.mark.task({t.id!r})"
        assert all(f.path.startswith(f"lessons/l{lesson}_") for f in t.functions)


def test_a_stub_keeps_marker_signature_and_docstring_and_raises_naming_its_task():
    text = '''class Pool:
    # Task L2.1: hand out blocks
    def alloc(self, n: int) -> list[int]:
        """Shapes live here."""
        # a hint that must go
        return list(range(n))

    def kept(self):
        return 1
'''
    stubbed = stub_text(text)
    assert "# Task L2.1: hand out blocks" in stubbed and '"""Shapes live here."""' in stubbed
    assert "a hint" not in stubbed and "return list(range(n))" not in stubbed
    assert "def kept(self):\n        return 1" in stubbed
    namespace: dict = {}
    exec(stubbed, namespace)
    with pytest.raises(NotImplementedError, match=r"L2 task 1 \(Pool.alloc\): hand out blocks"):
        namespace["Pool"]().alloc(3)
    assert function_source(stubbed, "Pool.kept") == "    def kept(self):\n        return 1\n"


def test_markers_that_skip_a_number_or_name_another_lesson_are_refused(tmp_path):
    (tmp_path / "lessons" / "l2_x").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    source = tmp_path / "lessons" / "l2_x" / "a.py"
    source.write_text("# Task L2.1: one\ndef f():\n    return 1\n\n\n# Task L2.3: three\ndef g():\n    return 3\n")
    with pytest.raises(TaskError, match=r"numbered \[1, 3\], not 1..2"):
        lesson_tasks(tmp_path, 2)
    source.write_text("# Task L3.1: one\ndef f():\n    return 1\n")
    with pytest.raises(TaskError, match="marked L3.1 in L2's folder"):
        lesson_tasks(tmp_path, 2)


def test_a_workspace_refuses_the_course_itself_and_a_full_folder(tmp_path):
    with pytest.raises(TaskError, match="inside the course itself"):
        start(ROOT, 1, ROOT / "docs" / "mine", cache=None)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(TaskError, match="exists and is not empty"):
        start(ROOT, 1, tmp_path / "full", cache=None)


def test_bad_lesson_and_task_are_one_line_exit_2(tmp_path):
    for args, message in ((["tasks", "L99"], "lesson 'L99': name one of L1..L"),
                          (["check", "L1", "--in", str(tmp_path)], "is not a course workspace")):
        run = course(*args, cache=tmp_path / "cache")
        assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def imports_the_course(node: ast.AST) -> bool:
    """Whether `node` (or anything in it) imports lessons or shared."""
    return any(any(a.name.split(".")[0] in ("lessons", "shared") for a in n.names) if isinstance(n, ast.Import)
               else n.level == 0 and (n.module or "").split(".")[0] in ("lessons", "shared")
               for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))


def is_entry_script(tree: ast.Module) -> bool:
    """A file run as a script (a top-level `if __name__ == "__main__":`), not a module scripts import."""
    return any(isinstance(s, ast.If) and ast.unparse(s.test) in ("__name__ == '__main__'", "'__main__' == __name__")
               for s in tree.body)


ENTRY_SCRIPTS = [p for p in sorted((ROOT / "scripts").rglob("*.py"))
                 if is_entry_script(tree := ast.parse(p.read_text())) and imports_the_course(tree)]


@pytest.mark.parametrize("script", ENTRY_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT / "scripts")))
def test_every_script_puts_its_own_tree_first_on_the_path(script):
    """Before its first top-level import of lessons or shared, a script puts the tree it sits in on sys.path (ahead
    of the editable install's finder, which only answers what sys.path does not): in a workspace it runs the
    workspace. Its sys.path statements (and the assignments they use) run here against a stand-in path."""
    body = ast.parse(script.read_text()).body
    first = next((i for i, s in enumerate(body) if imports_the_course(s)), len(body))
    setup = [s for s in body[:first] if "sys.path" in ast.unparse(s) or
             (isinstance(s, ast.Assign) and "__file__" in ast.unparse(s))]
    fake = SimpleNamespace(path=[])
    exec(compile(ast.Module(setup, type_ignores=[]), str(script), "exec"), {"Path": Path, "__file__": str(script),
                                                                             "sys": fake})
    assert any(Path(p).resolve() == ROOT for p in fake.path), (
        f"{script.relative_to(ROOT)} imports lessons/shared before it puts its own tree on sys.path: add "
        "sys.path.insert(0, str(Path(__file__).resolve().parents[N])) above its first such import")


def test_a_workspace_smoke_runs_the_workspace_not_the_installed_course(tmp_path):
    """A learner's own command, `python scripts/l2_smoke.py` in a fresh L2 workspace (its tasks stubbed) with the
    README's editable install in place and no PYTHONPATH: it runs the workspace's lessons, so it fails on the stubs
    and names the folder its lessons came from. (The editable install puts the course's lessons/ on the path; a
    script that did not put its own tree first ran the reference and printed PASS.)"""
    workspace = tmp_path / "ws"
    start(ROOT, 2, workspace, cache=None)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "scripts/l2_smoke.py"], cwd=workspace, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode != 0 and "PASS" not in run.stdout, run.stdout + run.stderr
    assert "NotImplementedError: L2 task" in run.stderr, run.stderr
    assert f"lessons from {workspace.resolve() / 'lessons'}" in run.stderr, run.stderr


@pytest.mark.slow
def test_l2_start_check_fill_in_reset_diff(tmp_path):
    """The issue's walk-through on L2: every task fails at the start; the reference bodies make them pass one by
    one; reset puts a stub back; diff shows the difference."""
    cache, workspace = tmp_path / "cache", tmp_path / "ws"
    run = course("start", "L2", "--into", str(workspace), cache=cache)
    assert run.returncode == 0, run.stderr
    tasks = lesson_tasks(ROOT, 2)
    run = course("check", "L2", cache=cache)
    assert run.returncode == 1 and f"L2: 0 of {len(tasks)} tasks pass; next: task 1" in run.stdout, run.stdout
    assert "not implemented yet: L2 task 1" in run.stdout
    for t in tasks[:2]:  # fill in tasks 1 and 2 with the reference's bodies
        for f in t.functions:
            mine = (workspace / f.path).read_text()
            reference = function_source((ROOT / f.path).read_text(), f.qualname)
            (workspace / f.path).write_text(mine.replace(function_source(mine, f.qualname), reference, 1))
    checked = course("check", "L2", "--in", str(workspace), cache=cache)
    assert f"L2: 2 of {len(tasks)} tasks pass; next: task 3" in checked.stdout, checked.stdout
    run = course("diff", "L2", "--task", "1", cache=cache)
    assert run.returncode == 0 and "the same as the reference" in run.stdout
    run = course("diff", "L2", "--task", "3", cache=cache)
    assert "+++ reference" in run.stdout and "raise NotImplementedError" in run.stdout
    total = sum(len(t.tests) for t in tasks)
    assert f"tests: {len(tasks[0].tests) + len(tasks[1].tests)} of {total} pass" in checked.stdout, checked.stdout
    run = course("check", "L2", "--task", "2", cache=cache)
    assert run.returncode == 0 and "L2: task 2 passes; next: task 3, `Request.slot`" in run.stdout, run.stdout
    mine = (workspace / tasks[1].functions[0].path).read_text()
    run = course("reset", "L2", "--task", "2", cache=cache)
    assert run.returncode == 0 and "your version is kept in " in run.stdout, run.stdout
    backup = Path(run.stdout.split("your version is kept in ")[1].strip())
    assert (backup / tasks[1].functions[0].path).read_text() == mine, "reset kept no copy of the learner's file"
    run = course("check", "L2", cache=cache)
    assert f"L2: 1 of {len(tasks)} tasks pass; next: task 2" in run.stdout, run.stdout
    (workspace / "tests" / "test_l2_allocator.py").unlink()  # task 1's tests: gone, so task 1 cannot pass
    run = course("check", "L2", cache=cache)
    assert f"L2: 0 of {len(tasks)} tasks pass; next: task 1" in run.stdout, run.stdout
    assert "could not run (not found in" in run.stdout and "test_l2_allocator.py::" in run.stdout, run.stdout


@pytest.mark.slow
def test_a_finished_lesson_names_the_next_one(tmp_path):
    cache, workspace = tmp_path / "cache", tmp_path / "ws"
    assert course("start", "L1", "--into", str(workspace), cache=cache).returncode == 0
    for path in {f.path for t in lesson_tasks(ROOT, 1) for f in t.functions}:  # every task filled in
        (workspace / path).write_text((ROOT / path).read_text())
    run = course("check", "L1", cache=cache)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "L1 is built. next lesson: L2 (docs/l2_token_flat.md)" in run.stdout, run.stdout


def test_a_full_folder_hint_and_the_docs_it_names_work(tmp_path):
    """The hints `start` prints lead somewhere that works: the workspace's own doc, and, given a folder that is
    already a workspace, the command to go on with it."""
    cache, workspace = tmp_path / "cache", tmp_path / "ws"
    run = course("start", "L2", "--into", str(workspace), cache=cache)
    doc = run.stdout.split("read ")[1].split(" (the learner's edition")[0]
    assert Path(doc).is_file(), run.stdout
    run = course("start", "L2", "--into", str(workspace), cache=cache)
    assert run.returncode == 2 and "go on with the workspace there" in run.stderr, run.stderr
    hint = run.stderr.split("`python ")[1].split("`")[0].split()
    again = course(*hint[1:], cache=cache)
    assert "running L2's task tests in" in again.stderr and again.returncode == 1, again.stdout + again.stderr


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda n: f"L{n}")
def test_the_workspace_holds_every_file_its_cards_test_command_names(lesson, tmp_path):
    from build_track.workspace import card_test_files

    start(ROOT, lesson, tmp_path / "ws", cache=None)
    named = card_test_files(ROOT, lesson)
    assert named, f"L{lesson}'s card names no test files"
    missing = [p.name for p in named if not (tmp_path / "ws" / "tests" / p.name).is_file()]
    assert not missing, f"L{lesson}'s card test command names {missing}, which its workspace lacks"


@pytest.mark.slow
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda n: f"L{n}")
def test_every_task_fails_stubbed_and_passes_filled_in(lesson):
    run = course("verify", f"L{lesson}")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda n: f"L{n}")
def test_each_lesson_doc_holds_its_generated_tasks_section(lesson):
    from course import doc_for, markdown

    doc = doc_for(lesson)
    text = doc.read_text()
    section = markdown(lesson)
    assert section in text, f"{doc.name}: paste `python scripts/course.py tasks L{lesson} --markdown` as its Tasks section"
    assert text.index(section) < text.rindex("\n## The smoke"), f"{doc.name}: Tasks comes before The smoke"


@pytest.mark.parametrize("lesson", LESSONS[:-1], ids=lambda n: f"L{n}")
def test_each_lesson_doc_ends_linking_the_next_lesson(lesson):
    from course import doc_for

    text = doc_for(lesson).read_text()
    last = text[text.rindex("\n## "):]
    assert f"**Next:** [L{lesson + 1}]({doc_for(lesson + 1).name})" in last, (
        f"{doc_for(lesson).name} does not end with a **Next:** line linking L{lesson + 1}'s doc")


@pytest.mark.parametrize("builds", [True, False], ids=["builds", "cannot"])
def test_check_says_when_a_kernel_build_starts_and_how_long_it_took(builds, tmp_path, capfd):
    """Before the task tests, `check` builds the kernels a lesson from L3 on uses, in the workspace, with the
    builder's own line when it starts and one when it is ready (or why it cannot build): a learner's first L4
    check otherwise sat a silent minute. A stand-in for L3's builder keeps this fast."""
    from course import build_kernels

    backends = tmp_path / "lessons" / "l3_block_tensor" / "backends"
    backends.mkdir(parents=True)
    for folder in (tmp_path / "lessons", backends.parent, backends):
        (folder / "__init__.py").write_text("")
    (backends / "cpp_backend.py").write_text(
        "import sys\nclass KernelUnavailable(Exception):\n    pass\ndef load_kernel():\n"
        "    print('building the C++ kernel stand-in (once; about a minute)', file=sys.stderr)\n"
        + ("    return None\n" if builds else "    raise KernelUnavailable('no C++ compiler (c++) on PATH')\n"))
    build_kernels(tmp_path, 4, quiet_below=0)
    said = capfd.readouterr().err
    assert "building the C++ kernel stand-in" in said, said
    if builds:
        assert "L3's C++ attention kernel: ready in " in said, said
    else:
        assert "note: L3's C++ attention kernel is unavailable (no C++ compiler (c++) on PATH); its tests skip" in said, said

"""What a learner copies out of the docs still works.

tests/test_docs.py checks quoted code and named files; this file checks the commands. Every piece of code
a reader can copy (each line of a fenced block, each inline code span, joined into one line where it wraps)
in docs/*.md and README.md is read as shell, split at `&&`, `;` and `|`:

- `pytest ... FILES -k EXPR` (or `python -m pytest ...`, or a bare `tests/FILE.py -k EXPR` in the prose):
  the named files, with the -k expression if any, collect at least one test. One `pytest --collect-only` run collects every named file, and pytest's
  own -k matcher judges each expression, so the semantics are exactly those of the command.
- `path.py::name` anywhere in a doc: the file defines a function or class of that name.
- `python scripts/X.py --opt ...`: every `--opt` is in X's `--help`. One subprocess prints every named
  script's help, so each script is asked once. Options shown alone (`--top-p 0.9`) must be accepted by
  some script the same doc names.
- Output blocks: `<!-- output -->` (or `<!-- output exit=N -->`, default 0; `exact` after either turns off the
  timing normalisation below, for figures in seconds that are arithmetic, not timings) on the line right before a
  fenced block whose first line is `$ [VAR=value ...] python scripts/X.py [options]`. The test runs that
  command on the embedded model, checks its exit status, and compares the rest of the block with what it
  printed (stdout, then stderr), token IDs included. Before comparing, both sides are normalised:
    1. trailing spaces are dropped;
    2. a timing line, one with a duration or a speed in it (`0.293 s`, `332s`, `12 ms`, `tok/s`,
       `0.84x HF's speed`), has every number replaced by `#` and its runs of spaces squeezed to one,
       so the doc can show a real run's timings and any run matches them;
    3. a run of rule characters (`─`) becomes two, so a rule drawn at any terminal width matches;
    4. the cache folder of the embedded model is written as `~/.cache/paged-attention-course`.
  A doc line that is just `...` stands for any number of output lines, and `...` inside a line for any
  text in that line. The command runs with COLUMNS=200, so rich wraps no line, OMP_NUM_THREADS=1, and
  CUDA hidden, so it runs on the CPU in fp32 as the docs show.
"""
from __future__ import annotations

import ast
import difflib
import functools
import glob
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
SEPARATORS = {"&&", "||", ";", "|", "&"}
VALUED_OPTIONS = {"-m", "-n", "--numprocesses", "--dist", "-p", "-c", "-o", "--tb", "--maxfail", "--durations", "--ignore", "--deselect", "--rootdir"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
SCRIPT = re.compile(r"(?<![\w/.-])scripts/[\w/]+\.py")
NODE_REF = re.compile(r"(?<![\w/.-])((?:tests|scripts|shared|lessons)/[\w/.-]+\.py)::([\w.:]+)")
HELP_OPTION = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
OUTPUT_MARKER = re.compile(r"^<!-- output(?: exit=\d+)?(?: exact)? -->", re.M)  # at a line start: prose may name it
OUTPUT_BLOCK = re.compile(r"^<!-- output(?: exit=(\d+))?( exact)? -->\n```[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
TIMING = re.compile(r"\d\s*(?:s|ms|tok/s)\b|\dx HF's speed")
NUMBER = re.compile(r"\d+(?:\.\d+)?")
RULE = re.compile(r"─{2,}")
DOC_CACHE = "~/.cache/paged-attention-course"


def _name(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------- commands


@dataclass
class Command:
    doc: str
    snippet: str
    argv: list[str]  # environment assignments removed


@dataclass
class PytestQuery:
    """What a doc's pytest command selects: its targets (files, folders, node ids) and -k expression."""
    doc: str
    snippet: str
    targets: list[str]
    keyword: str | None  # None: no -k
    missing: list[str]  # named paths that match no file


def snippets(text: str) -> list[str]:
    """Code a reader can copy: each fenced line, and each inline span with its line breaks joined."""
    lines = [line.removeprefix("$ ") for block in FENCE.findall(text) for line in block.splitlines()]
    prose = FENCE.sub("", text)
    return lines + [" ".join(body.split()) for _, body in SPAN.findall(prose)]


def shell_words(snippet: str) -> list[str] | None:
    """The snippet's words as a shell reads them, with `&&`, `;` and `|` as words of their own."""
    lexer = shlex.shlex(snippet, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        return list(lexer)
    except ValueError:  # an unclosed quote
        return None


def command_like(doc: Path) -> list[str]:
    # Prose in backticks (`--block-size N`, `kv_indices`) names no program, so it is not read as shell.
    # A bare `tests/x.py -k name` is a pytest selector too: the reader pastes it after `pytest`.
    return [s for s in snippets(doc.read_text())
            if "pytest" in s or "scripts/" in s or (s.startswith("tests/") and " -k " in s)]


def commands(doc: Path) -> list[Command]:
    found = []
    for snippet in command_like(doc):
        tokens = shell_words(snippet)
        if tokens is None:
            continue  # test_commands_are_shell reports it
        argv: list[str] = []
        for token in tokens + [";"]:
            if token not in SEPARATORS:
                argv.append(token)
                continue
            while argv and ENV_ASSIGNMENT.match(argv[0]):
                argv.pop(0)  # OMP_NUM_THREADS=1 python ...: the program is what follows
            if argv:
                found.append(Command(_name(doc), snippet, argv))
            argv = []
    return found


def pytest_args(argv: list[str]) -> list[str] | None:
    if argv[0] == "pytest":
        return argv[1:]
    if argv[0].startswith("tests/") and "-k" in argv:  # a bare selector, `tests/test_l5_scheduler.py -k swap`
        return argv
    if argv[0] in ("python", "python3") and argv[1:3] == ["-m", "pytest"]:
        return argv[3:]
    return None


def script_of(argv: list[str]) -> str | None:
    if argv[0] in ("python", "python3") and len(argv) > 1 and argv[1].startswith("scripts/"):
        return argv[1]
    return None


def pytest_queries(doc: Path) -> list[PytestQuery]:
    queries = []
    for cmd in commands(doc):
        args = pytest_args(cmd.argv)
        if args is None:
            continue
        targets, keyword, missing = [], None, []
        it = iter(args)
        for arg in it:
            if arg == "-k":
                keyword = next(it, "")
            elif arg.startswith("-k") and len(arg) > 2:
                keyword = arg[2:].lstrip("=")
            elif arg in VALUED_OPTIONS:
                next(it, None)  # `-p no:cacheprovider`: the value is not a path
            elif not arg.startswith("-"):
                path, sep, node = arg.partition("::")
                matches = sorted(glob.glob(path, root_dir=ROOT))
                missing += [] if matches else [path]
                targets += [m + sep + node for m in matches]
        if targets or missing or keyword is not None:
            queries.append(PytestQuery(cmd.doc, cmd.snippet, targets or ["tests"], keyword, missing))
    return queries


# A separate interpreter collects, so the docs test does not import every test module into its own session.
COLLECT = textwrap.dedent("""
    import json, sys
    import pytest
    from _pytest.mark import KeywordMatcher  # pytest's own -k matcher: the semantics of the command itself
    from _pytest.mark.expression import Expression

    queries, out = json.load(sys.stdin), sys.argv[1]

    class Keep:
        items, skipped = [], set()  # skipped: modules that skip at import (an optional extra not installed)
        def pytest_collection_modifyitems(self, items):
            Keep.items = list(items)
        def pytest_collectreport(self, report):
            if report.skipped and report.nodeid.endswith(".py"):
                Keep.skipped.add(report.nodeid)

    def selected_by(item, target):
        if "::" in target:  # a node id: the test itself, its parametrizations, or a class's tests
            return item.nodeid == target or item.nodeid.startswith((target + "[", target + "::"))
        return item.nodeid.startswith(target.rstrip("/") + ("::" if target.endswith(".py") else "/"))

    paths = sorted({t.partition("::")[0] for q in queries for t in q["targets"]})
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *paths], plugins=[Keep()])
    counts = []
    for q in queries:
        expr = None if q["keyword"] is None else Expression.compile(q["keyword"])
        # A module skipped at import still answers its command (pytest says "1 skipped", exit 0): count it once.
        skipped = sum(1 for t in q["targets"] if t.partition("::")[0] in Keep.skipped)
        counts.append(skipped + sum(1 for i in Keep.items if any(selected_by(i, t) for t in q["targets"])
                                    and (expr is None or expr.evaluate(KeywordMatcher.from_item(i)))))
    json.dump({"exit": int(code), "counts": counts}, open(out, "w"))
""")


@pytest.fixture(scope="session")
def collected_counts(tmp_path_factory) -> dict[int, int]:
    """How many tests each doc pytest command selects, keyed by id() of its query; one collection run."""
    queries = [q for doc in DOCS for q in pytest_queries(doc)]
    out = tmp_path_factory.mktemp("collect") / "counts.json"
    payload = json.dumps([{"targets": q.targets, "keyword": q.keyword} for q in queries])
    run = subprocess.run([sys.executable, "-c", COLLECT, str(out)], input=payload, capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.is_file(), f"collection crashed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    # Exit 5 is "no tests collected", which the per-query counts report better; anything else is broken.
    assert result["exit"] in (0, 5), f"collecting the tests the docs name failed:\n{run.stdout[-3000:]}"
    return {_key(q): n for q, n in zip(queries, result["counts"])}


def _key(q: PytestQuery) -> str:
    return json.dumps([q.doc, q.snippet, q.targets, q.keyword])


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_pytest_commands_select_tests(doc, collected_counts):
    queries = pytest_queries(doc)
    missing = [f"{path} (`{q.snippet}`)" for q in queries for path in q.missing]
    assert not missing, f"{_name(doc)}: pytest commands name paths that match no file: {missing}"
    empty = [q.snippet for q in queries if collected_counts[_key(q)] == 0]
    assert not empty, f"{_name(doc)}: these pytest commands select no test: {empty}"


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_commands_are_shell(doc):
    bad = [s for s in command_like(doc) if shell_words(s) is None]
    assert not bad, f"{_name(doc)}: these commands do not parse as shell (an unclosed quote?): {bad}"


def defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_named_functions_exist(doc):
    bad = []
    for path, name in NODE_REF.findall(doc.read_text()):
        source = ROOT / path
        parts = [p for p in re.split(r"::|\.", re.sub(r"\[.*", "", name)) if p]
        if not source.is_file() or not set(parts) <= defined_names(source):
            bad.append(f"{path}::{name}")
    assert not bad, f"{_name(doc)} names functions or tests that do not exist: {bad}"


# ------------------------------------------------------------------------------------------------ options

HELP = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    scripts, helps = json.loads(sys.argv[1]), {}
    for script in scripts:
        buf = io.StringIO()
        sys.argv = [script, "--help"]
        try:
            with contextlib.redirect_stdout(buf):
                runpy.run_path(script, run_name="__main__")
        except SystemExit:
            pass
        helps[script] = buf.getvalue()
    print(json.dumps(helps))
""")


def named_scripts(doc: Path) -> set[str]:
    """Scripts a doc names that a reader can run (they have a __main__ block)."""
    return {s for s in SCRIPT.findall(doc.read_text()) if (ROOT / s).is_file() and "__main__" in (ROOT / s).read_text()}


@pytest.fixture(scope="session")
def script_help() -> dict[str, str]:
    """Each named script's --help text; all of them in one interpreter, so torch is imported once."""
    scripts = sorted(set().union(*(named_scripts(doc) for doc in DOCS)))
    run = subprocess.run([sys.executable, "-c", HELP, json.dumps(scripts)], capture_output=True, text=True, cwd=ROOT,
                         timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, f"printing the scripts' --help failed:\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_script_options_exist(doc, script_help):
    bad = []
    for cmd in commands(doc):
        script = script_of(cmd.argv)
        if script is None:
            continue
        if not (ROOT / script).is_file():
            bad.append(f"{script} does not exist (`{cmd.snippet}`)")
            continue
        known = set(HELP_OPTION.findall(script_help[script]))
        assert known, f"{script} --help lists no options:\n{script_help[script]}"
        bad += [f"{script} has no {opt} (`{cmd.snippet}`)" for arg in cmd.argv[2:] if arg.startswith("--")
                if (opt := arg.split("=", 1)[0]) not in known]
    assert not bad, f"{_name(doc)}: " + "; ".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_loose_options_exist(doc, script_help):
    """A span of options alone (`--temperature 0.8 --seed 3`) has no script beside it: each option must be
    one that some script this doc names accepts, so a renamed option cannot stay in the prose."""
    known = set().union(*(HELP_OPTION.findall(script_help[s]) for s in named_scripts(doc)))
    bad = sorted({opt for snippet in snippets(doc.read_text()) if snippet.startswith("--")
                  for opt in HELP_OPTION.findall(snippet) if opt not in known})
    assert not bad, f"{_name(doc)} shows options no script it names accepts: {bad}"


# ------------------------------------------------------------------------------------------------ outputs


@dataclass
class OutputBlock:
    doc: Path
    line: int
    exit: int
    command: str
    expected: list[str]
    exact: bool  # no timing normalisation: every number is compared (sizing figures in seconds, not timings)


def output_blocks(doc: Path) -> list[OutputBlock]:
    text = doc.read_text()
    blocks = []
    for m in OUTPUT_BLOCK.finditer(text):
        first, *rest = m.group(3).splitlines() or [""]
        blocks.append(OutputBlock(doc, text.count("\n", 0, m.start()) + 1, int(m.group(1) or 0), first, rest,
                                  bool(m.group(2))))
    return blocks


def normalise(line: str, cache: str | None = None, exact: bool = False) -> str:
    if cache:
        line = line.replace(cache, DOC_CACHE)
    line = RULE.sub("──", line.rstrip())
    if TIMING.search(line) and not exact:
        line = re.sub(r" +", " ", NUMBER.sub("#", line))
    return line


def expected_pattern(lines: list[str], exact: bool = False) -> re.Pattern:
    parts = []
    for line in lines:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(re.escape(normalise(line, exact=exact)).replace(r"\.\.\.", r"[^\n]*?") + r"\n")
    return re.compile("".join(parts))


ALL_OUTPUT_BLOCKS = [b for doc in DOCS for b in output_blocks(doc)]


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_output_marker_has_a_runnable_block(doc):
    text = doc.read_text()
    blocks = output_blocks(doc)
    assert len(blocks) == len(OUTPUT_MARKER.findall(text)), (
        f"{_name(doc)}: an output marker is not followed by a fenced block")
    for b in blocks:
        argv = shlex.split(b.command.removeprefix("$ "))
        while argv and ENV_ASSIGNMENT.match(argv[0]):
            argv.pop(0)
        assert b.command.startswith("$ ") and argv and script_of(argv), (
            f"{_name(doc)}:{b.line}: an output block starts with `$ python scripts/...`, not {b.command!r}")


def doc_run_env() -> dict[str, str]:
    """How a doc's command runs in a test: no line wrapping, one thread, offline, CUDA hidden (CPU and fp32, as
    the docs show). tests/test_doc_numbers.py runs its commands the same way."""
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("FORCE_COLOR", None)  # colour codes would be compared as text
    return env


@functools.lru_cache(maxsize=None)
def run_doc_command(command: str) -> subprocess.CompletedProcess:
    """`[VAR=value ...] python scripts/X.py ...` run as doc_run_env says, from the repository root. Memoised per
    session: a command that several output blocks show, or that tests/test_doc_numbers.py also quotes (sizing.py,
    the smokes, tp 2 included), runs once, and every test judges that one run's exit status and output. Under
    pytest -n the workers share the memo through a folder of this run's own (PYTEST_XDIST_TESTRUNUID), the first
    to ask running the command while the others wait on its lock."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        return _run_doc_command(command)
    from filelock import FileLock  # transformers' own dependency

    folder = Path(tempfile.gettempdir()) / f"doc-runs-{run_id}"
    folder.mkdir(exist_ok=True)
    stored = folder / f"{hashlib.sha256(command.encode()).hexdigest()[:16]}.json"
    with FileLock(str(stored) + ".lock", timeout=900):  # the holder's command times out at 300 s
        if stored.exists():
            saved = json.loads(stored.read_text())
            return subprocess.CompletedProcess(saved["args"], saved["returncode"], saved["stdout"], saved["stderr"])
        run = _run_doc_command(command)
        stored.write_text(json.dumps({"args": run.args, "returncode": run.returncode, "stdout": run.stdout,
                                      "stderr": run.stderr}))
        return run


def _run_doc_command(command: str) -> subprocess.CompletedProcess:
    words = shlex.split(command)
    env = doc_run_env()  # CUDA hidden: `--device auto` then means the CPU and fp32 on every machine, as docs show
    while words and ENV_ASSIGNMENT.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    assert words and words[0] == "python", f"a doc command runs `python ...`, not {command!r}"
    return subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


@pytest.mark.slow  # every command the docs show, run again: CI runs these right after the README's command
@pytest.mark.parametrize("block", ALL_OUTPUT_BLOCKS, ids=lambda b: f"{_name(b.doc)}:{b.line}")
def test_output_block_is_what_the_command_prints(block):
    from shared.tiny_qwen3 import cache_root

    run = run_doc_command(block.command.removeprefix("$ "))
    actual = [normalise(line, str(cache_root()), block.exact) for line in (run.stdout + run.stderr).splitlines()]
    where = f"{block.doc.name}:{block.line} `{block.command}`"
    assert run.returncode == block.exit, (
        f"{where} exited {run.returncode}, the doc says {block.exit}:\n{run.stderr[-2000:]}")
    if expected_pattern(block.expected, block.exact).fullmatch("".join(line + "\n" for line in actual)) is None:
        expected = [normalise(line, exact=block.exact) for line in block.expected]
        diff = "\n".join(difflib.unified_diff(expected, actual, "doc", "now", lineterm=""))
        pytest.fail(f"{where} no longer prints what the doc shows (normalised as this file's docstring says):\n{diff}")

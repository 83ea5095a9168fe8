"""A workspace's docs are the learner's edition (scripts/build_track/learner_doc.py): no line of a task's reference
body appears in any of them, and each task's contract names what its tests require: the messages they match and
the dtypes they name."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]
from build_track.learner_doc import body_lines, code_of  # noqa: E402
from build_track.tasks import lesson_tasks, lessons  # noqa: E402
from build_track.workspace import start  # noqa: E402

DTYPE = re.compile(r"\btorch\.(int8|int32|int64|bool|float32|bfloat16|float16)\b")


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory) -> dict[int, Path]:
    made = {}
    for lesson in lessons(ROOT):
        made[lesson] = tmp_path_factory.mktemp(f"l{lesson}") / "ws"
        start(ROOT, lesson, made[lesson], cache=None)
    return made


@pytest.mark.parametrize("lesson", lessons(ROOT), ids=lambda n: f"L{n}")
def test_no_workspace_doc_shows_a_task_body(lesson, workspaces):
    hidden = body_lines(ROOT, lesson)
    assert hidden, f"L{lesson}'s tasks have no body lines to hide"
    docs = sorted((workspaces[lesson] / "docs").glob("*.md"))
    assert any(d.name.startswith(f"l{lesson}_") for d in docs), f"L{lesson}'s workspace has no doc of its own"
    for doc in docs:
        for fence in re.findall(r"^```[^\n]*\n(.*?)^```", doc.read_text(), re.M | re.S):
            for line in fence.splitlines():
                code = code_of(line)
                assert code not in hidden, (f"{doc.name} in L{lesson}'s workspace shows task "
                                            f"L{lesson}.{hidden.get(code)}'s line `{code}`")
    reference = next(p for p in (ROOT / "docs").glob(f"l{lesson}_*.md") if not p.stem.endswith("_appendix"))
    if "<!-- quote:" in reference.read_text():  # the check above can fail: the reference doc shows task bodies
        shown = {code_of(line) for line in reference.read_text().splitlines()}
        assert shown & set(hidden) or lesson not in (2, 4), f"{reference.name} quotes no task body any more"


def _required(test_source: str) -> tuple[set[str], set[str]]:
    """(messages, dtypes) a test requires: the plain text of each `match=` it passes (its parametrized values
    too), leaving out patterns with digits (formatted values the given code writes); the dtypes its asserts on a
    `dtype` name."""
    tree = ast.parse(test_source)
    params: dict[str, list] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("parametrize") and len(node.args) >= 2:
            names = [n.strip() for n in ast.literal_eval(node.args[0]).split(",")] if isinstance(
                node.args[0], ast.Constant) else []
            try:
                rows = ast.literal_eval(node.args[1])
            except ValueError:
                continue
            for i, name in enumerate(names):
                params[name] = [row[i] if len(names) > 1 else row for row in rows]
    messages = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "match":
            values = ([node.value.value] if isinstance(node.value, ast.Constant)
                      else params.get(getattr(node.value, "id", ""), []))
            for value in values:
                text = re.sub(r"'[^']*'", "{...}", re.sub(r"\\(.)", r"\1", str(value)))  # a quoted value: any
                if not re.search(r"\d", text) and not re.search(r"[\[\]*+?|^$]", text):
                    messages.add(text)
    asserts = [line for node in ast.walk(tree) if isinstance(node, ast.Assert) and "dtype" in (line := ast.unparse(node))]
    given = DTYPE.findall(re.sub(r"^\s*assert .*$", "", test_source, flags=re.M))  # a dtype the test passes in
    raised = {ast.unparse(n.exc) for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None}
    return {m for m in messages if not any(m in r for r in raised)}, {
        d for line in asserts for d in DTYPE.findall(line) if d not in given}


SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@pytest.mark.parametrize("lesson", lessons(ROOT), ids=lambda n: f"L{n}")
def test_each_contract_names_the_messages_and_dtypes_its_tests_require(lesson, workspaces):
    doc = next(p for p in (workspaces[lesson] / "docs").glob(f"l{lesson}_*.md") if not p.stem.endswith("_appendix"))
    text = doc.read_text()
    contracts = text[text.index("### Every task's contract"):]
    for task in lesson_tasks(ROOT, lesson):
        start_at = contracts.index(f"> **Task {task.id}, ")
        end_at = contracts.find("> **Task ", start_at + 1)
        mine = contracts[start_at:end_at if end_at > 0 else None]
        for test in task.tests:
            path, name = test.split("::")
            module = ast.parse((ROOT / path).read_text())
            fn = next(n for n in module.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
            decorators = "\n".join(ast.unparse(d) for d in fn.decorator_list)
            messages, dtypes = _required(decorators + "\n" + ast.unparse(fn))
            for message in messages:
                assert message in mine, f"{task.id}'s contract does not say the message {message!r} that {name} matches"
            for dtype in dtypes:
                assert dtype in mine or SHORT.get(dtype, dtype) in mine, f"{task.id}'s contract does not name the dtype {dtype} that {name} uses"

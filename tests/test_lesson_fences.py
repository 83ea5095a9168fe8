"""Code a later lesson adds to an earlier lesson's file is fenced and named: `# >>> L11` ... `# <<< L11` in
Python, `// >>> L12` ... `// <<< L12` in C++. A learner reading the earlier lesson skips the blocks; these tests
hold that the rest is that lesson's code, whole: the fences are well formed and name a later lesson, L3's
kernel compiles with L12's blocks cut out, and L8's `scored_rows` without L11's block gives L8's rows.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(?:#|//) (>>>|<<<) L(\d+)\b")
KERNEL = ROOT / "lessons/l3_block_tensor/backends/paged_attention.cpp"
L8_RUNNER = ROOT / "lessons/l8_chunked_prefill/runner.py"
SOURCES = sorted(p for p in (ROOT / "lessons").rglob("*") if p.suffix in (".py", ".cpp"))


def fences(text: str) -> list[tuple[int, int, int]]:
    """(lesson, first line, last line) of each fenced block, 1-based; ValueError on a fence out of place."""
    blocks, open_at, lesson = [], None, None
    for n, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if not match:
            continue
        kind, number = match.group(1), int(match.group(2))
        if kind == ">>>":
            if open_at is not None:
                raise ValueError(f"line {n}: L{number}'s block opens inside L{lesson}'s (line {open_at})")
            open_at, lesson = n, number
        else:
            if open_at is None or number != lesson:
                raise ValueError(f"line {n}: `<<< L{number}` closes no open L{number} block")
            blocks.append((lesson, open_at, n))
            open_at = None
    if open_at is not None:
        raise ValueError(f"line {open_at}: L{lesson}'s block is never closed")
    return blocks


def without(text: str, lesson: int) -> str:
    """The text with every block of `lesson` cut out, fences included."""
    cut = {n for number, a, b in fences(text) if number == lesson for n in range(a, b + 1)}
    return "".join(line for n, line in enumerate(text.splitlines(keepends=True), 1) if n not in cut)


def own_lesson(path: Path) -> int:
    return int(re.match(r"l(\d+)_", path.relative_to(ROOT / "lessons").parts[0]).group(1))


def test_the_parser_refuses_bad_fences():
    assert fences("a\n# >>> L11: why\nb\n# <<< L11\nc\n") == [(11, 2, 4)]
    assert without("a\n# >>> L11\nb\n# <<< L11\nc\n", 11) == "a\nc\n"
    for bad in ("# >>> L11\n", "# <<< L11\n", "# >>> L11\n# <<< L12\n", "// >>> L12\n// >>> L12\n"):
        with pytest.raises(ValueError):
            fences(bad)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_fences_are_well_formed_and_name_a_later_lesson(path):
    text = path.read_text()
    for lesson, start, _ in fences(text):
        assert lesson > own_lesson(path), f"{path.name}:{start}: L{lesson}'s block in L{own_lesson(path)}'s file"
        assert list((ROOT / "lessons").glob(f"l{lesson}_*")), f"{path.name}:{start}: there is no lesson L{lesson}"


def test_the_fenced_files_are_the_ones_the_docs_name():
    fenced = {p.relative_to(ROOT).as_posix() for p in SOURCES if fences(p.read_text())}
    assert fenced == {KERNEL.relative_to(ROOT).as_posix(), L8_RUNNER.relative_to(ROOT).as_posix()}


def test_l12_blocks_hold_every_int8_line_of_the_kernel():
    l3 = without(KERNEL.read_text(), 12)
    # What is left may name L12 in a comment and keep the flag L12's block sets; no int8 code is left.
    for word in ("int8_t", "kInt8", "kScaleBytes", "row_scales", "scale_keys", "scales"):
        assert not re.search(rf"\b{word}\b", l3), f"`{word}` outside L12's blocks in {KERNEL.name}"


@pytest.mark.slow  # a real kernel build
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_the_kernel_without_l12_compiles():
    """L3's kernel, read without L12's blocks, is a whole program: it compiles (syntax and types, no code
    generated: about 17 s on a 2-core EPYC, most of it torch's headers)."""
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    result = subprocess.run(["c++", "-fsyntax-only", "-std=c++17", "-w", "-x", "c++", "-DTORCH_EXTENSION_NAME=l3",
                             *includes, "-"], input=without(KERNEL.read_text(), 12), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def _scored_rows(lesson_to_cut: int | None):
    source = L8_RUNNER.read_text()
    if lesson_to_cut is not None:
        source = without(source, lesson_to_cut)
    module: dict = {"__name__": "l8_runner_copy"}
    exec(compile(source, str(L8_RUNNER), "exec"), module)
    return module["scored_rows"]


def _step(fed: list[int], decode: list[bool], samples: list[bool]):
    bounds = [0]
    for n in fed:
        bounds.append(bounds[-1] + n)
    meta = SimpleNamespace(qo_indptr=torch.tensor(bounds), last_rows=torch.tensor(bounds[1:]) - 1)
    return [SimpleNamespace(decode=d, samples=s) for d, s in zip(decode, samples)], meta


def test_l8_rows_without_l11s_block_are_l8s():
    """A step of L8's (decodes feed one token; prompt slices sample only when they finish): the same rows with
    L11's block and without it. A verify slice (a decode feeding 3 tokens) needs the block."""
    l8, full = _scored_rows(11), _scored_rows(None)
    slices, meta = _step([1, 5, 4, 1], [True, False, False, True], [True, False, True, True])
    assert l8(slices, meta).tolist() == full(slices, meta).tolist() == [0, 9, 10]
    slices, meta = _step([3, 2], [True, False], [True, True])
    assert full(slices, meta).tolist() == [0, 1, 2, 4]
    assert l8(slices, meta).tolist() == [2, 4]

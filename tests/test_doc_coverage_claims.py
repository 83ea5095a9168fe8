"""What L14's doc says a test covers is what the test's parameters are.

docs/l14_batch_invariant.md and its appendix say how many row counts, places, threads, K values, tiles, fillers
and batch sizes the L14 tests run. Each such sentence is matched here and its numbers compared with the numbers in
the test module itself, read with `ast` (nothing is imported or run): ROW_COUNTS and THREADS in
tests/test_l14_ops.py, the places `rows_of` takes, the thread count the autouse fixture sets, the parametrize
lists, the attention test's `ways`, and the invariance tests' crowd sizes and batch sizes. Change a parameter
and not the doc, or the doc and not the parameter, and the pair named fails here. A sentence reworded so its
pattern no longer matches fails too, naming the pattern: update both together.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "l14_batch_invariant.md"
APPENDIX = ROOT / "docs" / "l14_batch_invariant_appendix.md"
OPS = ROOT / "tests" / "test_l14_ops.py"
INVARIANCE = ROOT / "tests" / "test_l14_invariance.py"
NUM = re.compile(r"\d{1,3}(?:,\d{3})+|\d+")
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4}


def nums(text: str) -> list[int]:
    """The integers in a phrase, in order: `1, 2 and 16` -> [1, 2, 16]; `2,048` is one number."""
    return [int(n.replace(",", "")) for n in NUM.findall(text)]


def stated(doc: Path, pattern: str) -> re.Match:
    text = " ".join(doc.read_text().split())
    m = re.search(pattern, text)
    assert m, f"{doc.relative_to(ROOT)} no longer says /{pattern}/: reword this test with the doc, from the test's parameters"
    return m


@lru_cache(maxsize=None)
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def assigned(path: Path, name: str):
    """A module-level constant, `NAME = [...]` or one name of `A, B = 1, 2`."""
    for node in tree(path).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == name:
                    return ast.literal_eval(node.value)
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for t, v in zip(target.elts, node.value.elts):
                        if isinstance(t, ast.Name) and t.id == name:
                            return ast.literal_eval(v)
    raise AssertionError(f"{path.relative_to(ROOT)} defines no {name}")


def function(path: Path, name: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(tree(path)) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{path.relative_to(ROOT)} has no function {name}"
    return found[0]


def calls(node: ast.AST, name: str) -> list[ast.Call]:
    """Calls of `name` or `x.name` inside node."""
    return [c for c in ast.walk(node) if isinstance(c, ast.Call)
            and ((isinstance(c.func, ast.Name) and c.func.id == name)
                 or (isinstance(c.func, ast.Attribute) and c.func.attr == name))]


def parametrized(path: Path, test: str, argnames: str) -> list:
    """The values of `@pytest.mark.parametrize(argnames, [...])` on a test; a name (THREADS) is looked up."""
    for deco in function(path, test).decorator_list:
        if isinstance(deco, ast.Call) and calls(deco, "parametrize") and ast.literal_eval(deco.args[0]) == argnames:
            values = deco.args[1]
            if isinstance(values, ast.Name):
                return assigned(path, values.id)
            return [ast.unparse(v) if isinstance(v, ast.Attribute) else ast.literal_eval(v) for v in values.elts]
    raise AssertionError(f"{path.relative_to(ROOT)}::{test} is not parametrized over {argnames!r}")


def loop_values(node: ast.AST, target: str) -> list:
    """What `for target in ...` walks, where the iterable is literal (`range` allowed)."""
    for loop in ast.walk(node):
        if isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and loop.target.id == target:
            code = compile(ast.Expression(loop.iter), "<loop>", "eval")
            return list(eval(code, {"__builtins__": {}, "range": range}, {}))  # a literal list or tuple of ranges
    raise AssertionError(f"no `for {target} in ...` loop")


def rows_in_x(test: str) -> int:
    """The rows of the x a test builds with torch.randn(ROWS, ...)."""
    return {ast.literal_eval(c.args[0]) for c in calls(function(OPS, test), "randn")
            if isinstance(c.args[0], ast.Constant)}.pop()


def threads_of_fixture() -> int:
    (call,) = [c for c in calls(function(OPS, "one_thread"), "set_num_threads") if isinstance(c.args[0], ast.Constant)]
    return call.args[0].value


# ------------------------------------------------------------------------------------------------ the ops test


def test_the_matmul_row_counts_and_places_are_the_tests():
    m = stated(DOC, r"`tests/test_l14_ops\.py` holds it to that at (\d+) row counts \(([\d, ]+):.*? each at (\d+) "
                    r"places in a (\d+)-row x")
    count, listed, places, rows = int(m.group(1)), nums(m.group(2)), int(m.group(3)), int(m.group(4))
    row_counts = assigned(OPS, "ROW_COUNTS")
    assert listed == row_counts, f"{DOC.name} lists row counts {listed}; ROW_COUNTS in {OPS.name} is {row_counts}"
    assert count == len(row_counts), f"{DOC.name} says {count} row counts; ROW_COUNTS holds {len(row_counts)}"
    starts = [loop for loop in ast.walk(function(OPS, "rows_of")) if isinstance(loop, ast.For)
              and isinstance(loop.target, ast.Name) and loop.target.id == "start"]
    assert len(starts) == 1 and isinstance(starts[0].iter, ast.Tuple), f"{OPS.name}'s rows_of no longer loops over a tuple of starts"
    assert places == len(starts[0].iter.elts), (
        f"{DOC.name} says {places} places; {OPS.name}'s rows_of takes {len(starts[0].iter.elts)}")
    for test in ("test_linear_rows_are_bitwise_the_same_for_any_batch", "test_rms_norm_rows_are_invariant_and_hf_arithmetic"):
        assert rows_in_x(test) == rows, f"{DOC.name} says a {rows}-row x; {test} builds {rows_in_x(test)} rows"
    assert max(row_counts) == rows, f"{DOC.name}'s largest row count is the whole x ({rows}); ROW_COUNTS' is {max(row_counts)}"

    a = stated(APPENDIX, r"the matmul and RMSNorm at (\d+) row counts from (\d+) to (\d+), each at (\d+) places in x")
    said = [int(g) for g in a.groups()]
    assert said == [len(row_counts), min(row_counts), max(row_counts), places], (
        f"{APPENDIX.name} says {said} (count, first, last, places); the test: {len(row_counts)} row counts from "
        f"{min(row_counts)} to {max(row_counts)}, {places} places")


def test_the_matmul_dtypes_k_and_threads_are_the_tests():
    m = stated(DOC, r"against every row alone; fp32 and bf16; K = ([\d, and]+) \(a tail\); and on ([\d, and]+) threads\.")
    ks, threads = nums(m.group(1)), nums(m.group(2))
    shapes = parametrized(OPS, "test_linear_rows_are_bitwise_the_same_for_any_batch", "k,n")
    assert ks == [k for k, _ in shapes], f"{DOC.name} says K = {ks}; the test's (k, n) are {shapes}"
    assert any(k % 8 for k, _ in shapes), f"{DOC.name} promises a K with a tail; the test's K are {[k for k, _ in shapes]}"
    dtypes = parametrized(OPS, "test_linear_rows_are_bitwise_the_same_for_any_batch", "dtype")
    assert dtypes == ["torch.float32", "torch.bfloat16"], f"{DOC.name} says fp32 and bf16; the test runs {dtypes}"
    tested = [threads_of_fixture(), *parametrized(
        OPS, "test_linear_keeps_leading_dimensions_and_the_thread_count_does_not_matter", "threads")]
    assert threads == tested, f"{DOC.name} says {threads} threads; {OPS.name} runs the fixture's one and THREADS: {tested}"
    a = stated(APPENDIX, r"the matmul on ([\d, and]+) threads")
    assert nums(a.group(1)) == tested, f"{APPENDIX.name} says {nums(a.group(1))} threads; {OPS.name} runs {tested}"


def test_the_attention_ways_are_the_tests():
    m = stated(DOC, r"attends one (\d+)-row request whole, in slices, as (\d+) decode rows, in tiles of (\d+) and (\d+) "
                    r"rows, on (\w+) threads with its heads split, and beside (\d+) other decodes")
    rows, decodes, tile_a, tile_b, threads, others = m.groups()
    h = assigned(OPS, "H")
    assert int(rows) == int(decodes) == h, f"{DOC.name} says a {rows}-row request, {decodes} decode rows; H = {h}"
    ways = [n for n in ast.walk(function(OPS, "test_attention_rows_are_the_same_whole_sliced_decoded_and_in_a_crowd"))
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "ways"]
    assert ways, f"{OPS.name}'s attention test no longer builds `ways`"
    # each way: (parts, tile_rows, threads, others)
    values = [tuple(ast.literal_eval(e) for e in v.elts[1:]) for v in ways[0].value.values]
    tiles, thread_counts, crowds = {t for t, _, _ in values}, {n for _, n, _ in values}, {o for _, _, o in values} - {0}
    assert {int(tile_a), int(tile_b)} == tiles - {32}, f"{DOC.name} says tiles of {tile_a} and {tile_b} rows; the ways use {tiles}"
    assert WORDS[threads] in thread_counts, f"{DOC.name} says {threads} threads; the ways use {thread_counts}"
    assert {int(others)} == crowds, f"{DOC.name} says beside {others} other decodes; the ways put {crowds} beside it"


# ----------------------------------------------------------------------------------------- the invariance tests


def test_the_invariance_crowds_and_batch_sizes_are_the_tests():
    m = stated(DOC, r"a needle among (\d+) fillers, batch 1 against (\d+), a sliced prompt at (\d+) batch sizes from "
                    r"(\d+) to (\d+)")
    fillers, batch, count, first, last = (int(g) for g in m.groups())
    needle = calls(function(INVARIANCE, "test_needle_alone_equals_needle_among_64_fillers_anywhere"), "random_prompts")
    assert [ast.literal_eval(c.args[0]) for c in needle] == [fillers], f"{DOC.name} says {fillers} fillers"
    together = calls(function(INVARIANCE, "test_batch_of_32_equals_each_alone"), "random_prompts")
    assert [ast.literal_eval(c.args[0]) for c in together] == [batch], f"{DOC.name} says batch 1 against {batch}"
    sizes = loop_values(function(INVARIANCE, "test_long_prompt_sliced_at_batch_sizes_1_to_17"), "size")
    assert (count, first, last) == (len(sizes), min(sizes), max(sizes)), (
        f"{DOC.name} says {count} batch sizes from {first} to {last}; the test runs {sizes}")
    a = stated(APPENDIX, r"a (\d+)-token prompt at batch sizes ([\d, -]+) under")
    ranges = [list(range(int(x), int(y) + 1)) if y else [int(x)]
              for x, y in re.findall(r"(\d+)(?:-(\d+))?", a.group(2))]
    assert [s for r in ranges for s in r] == sizes, f"{APPENDIX.name} says batch sizes {a.group(2)}; the test runs {sizes}"


def test_the_prefix_lengths_are_the_tests():
    a = stated(APPENDIX, r"prefixes of ([\d, and]+) tokens")
    lengths = parametrized(INVARIANCE, "test_prefix_cache_cold_against_hot", "prefix_len")
    assert nums(a.group(1)) == lengths, f"{APPENDIX.name} says prefixes of {nums(a.group(1))}; the test runs {lengths}"


# ------------------------------------------------------------------------------------------ the kernel's blocking


def constant(name: str) -> int:
    m = re.search(rf"constexpr int(?:64_t)? {name} = (\d+);", (ROOT / "shared/cpu_ops.cpp").read_text())
    assert m, f"shared/cpu_ops.cpp no longer defines {name}"
    return int(m.group(1))


@pytest.mark.parametrize("doc", [DOC, APPENDIX], ids=lambda p: p.name)
def test_how_often_w_is_read_is_the_kernels_blocking(doc):
    """W is read from memory once per row block (kRowBlock rows), each kTile x kTile tile rereading its rows of W
    from cache; threads own blocks of kColBlock columns."""
    m = stated(doc, r"reads W from memory once per (\d+)-row block \((?:each|its) (\d+) x (\d+) tiles? rereads?")
    block, r, c = (int(g) for g in m.groups())
    assert block == constant("kRowBlock"), f"{doc.name} says W is read once per {block} rows; kRowBlock is {constant('kRowBlock')}"
    assert r == c == constant("kTile"), f"{doc.name} says {r} x {c} tiles; kTile is {constant('kTile')}"
    if doc == DOC:
        cols = int(stated(doc, r"Threads own whole blocks of (\d+) columns").group(1))
        assert cols == constant("kColBlock"), f"{doc.name} says blocks of {cols} columns; kColBlock is {constant('kColBlock')}"

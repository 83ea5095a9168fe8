"""scripts/checks/parity_matrix.py judges each smoke run by the contract and builds the grid it promises; no smoke runs here
(the matrix itself takes minutes: .ci/run runs it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "checks"))
import parity_matrix as pm  # noqa: E402


def smoke_json(*verdicts: dict, extra: dict | None = None) -> str:
    """What a smoke prints with --json: here one prompt, judged for L3 and L2 (the verdicts given)."""
    entry = {"prompt": "a", "prompt_ids": [64], "hf": [1, 2]}
    for name, verdict in zip(["L3", "L2"], verdicts):
        entry[name] = [1, 2]
        entry[f"{name}_verdict"] = verdict
    entry["match"] = all(v["status"] != "mismatch" for v in verdicts)
    result = {"lesson": "L3", "prompts": [entry], "match": entry["match"]}
    if extra is not None:
        result["extra_check"] = extra
    return json.dumps(result) + "\n"


MATCH = {"status": "match", "judged": 2}  # each engine generated 2 tokens in smoke_json: all judged
TIE = {"status": "tie", "position": 3, "ours": 7, "theirs": 8, "margin": 0.25, "tolerance": 0.75, "runner_up": 7,
       "judged": 2, "ties": [3]}
MISMATCH = {"status": "mismatch", "position": 1, "ours": 643, "theirs": 36928, "margin": 3.2, "tolerance": 0.0,
            "runner_up": 11, "judged": 2, "ties": []}


def test_every_engine_identical_is_pass():
    assert pm.classify(0, smoke_json(MATCH, MATCH), "").status == "PASS"


def test_a_half_precision_tie_is_tie_and_says_so():
    out = pm.classify(0, smoke_json(TIE, MATCH), "")
    assert out.status == "TIE" and "numerical tie" in out.note and "position 3" in out.note


def test_a_mismatch_is_fail_and_names_the_position():
    out = pm.classify(1, smoke_json(MATCH, MISMATCH), "")
    assert out.status == "FAIL" and "L2 at position 1: ours 643, HF 36928" in out.note


def test_a_late_mismatch_after_a_tie_is_fail_and_names_the_ties():
    late = MISMATCH | {"position": 14, "ties": [3, 9]}
    out = pm.classify(1, smoke_json(MATCH, late), "")
    assert out.status == "FAIL" and "L2 at position 14" in out.note and "ties at 3, 9" in out.note


def test_positions_judged_are_counted_against_tokens_generated():
    out = pm.classify(0, smoke_json(TIE | {"ties": [3, 5]}, MATCH), "")
    assert (out.status, out.judged, out.tokens) == ("TIE", 4, 4) and "ties at 3, 5" in out.note
    out = pm.classify(1, smoke_json(MATCH, MISMATCH | {"judged": 1}), "")
    assert (out.status, out.judged, out.tokens) == ("FAIL", 3, 4)  # a mismatch stops the judging


def test_the_summary_counts_runs_and_positions_judged():
    outcomes = [pm.Outcome("PASS", "", 40, 40), pm.Outcome("TIE", "numerical tie: ...", 80, 80)]
    assert pm.summary(outcomes, 12.3) == ("2 smoke runs in 12 s: 1 PASS, 1 TIE, 0 FAIL, 0 ERROR; "
                                          "positions judged: 120 of 120 generated tokens")


@pytest.mark.parametrize("verdict", [MATCH | {"judged": 1}, TIE | {"judged": 1}, {"status": "match"}])
def test_a_pass_that_did_not_judge_every_token_is_error(verdict):
    """A tie whose later tokens went unjudged (or a verdict without the count) is no verdict on those tokens."""
    out = pm.classify(0, smoke_json(verdict, MATCH), "")
    assert out.status == "ERROR" and "not every position judged: prompt 0 L3:" in out.note


def test_a_failed_lesson_check_is_fail():
    extra = {"ok": False, "message": "L6: 0 served from the cache"}
    out = pm.classify(1, smoke_json(MATCH, MATCH, extra=extra), "")
    assert out.status == "FAIL" and "0 served from the cache" in out.note


def test_exit_0_with_a_mismatch_in_the_json_is_still_fail():
    assert pm.classify(0, smoke_json(MISMATCH, MATCH), "").status == "FAIL"


@pytest.mark.parametrize("code, stdout, stderr", [
    (2, "", "error: block-size must be at least 1, got 0\n"),  # bad input: the contract's exit 2
    (1, "", "Traceback (most recent call last):\nIndexError: list index out of range\n"),  # a crash also exits 1
    (0, "not json\n", ""),
    (0, json.dumps({"lesson": "L3"}) + "\n", ""),  # JSON without the verdicts
    (-9, smoke_json(MATCH, MATCH), ""),  # killed after printing
    (None, "", ""),  # timed out
])
def test_no_verdict_is_error(code, stdout, stderr):
    out = pm.classify(code, stdout, stderr)
    assert out.status == "ERROR"
    if stderr:
        assert stderr.strip().splitlines()[-1] in out.note  # the reason is shown, not just "ERROR"


def test_lessons_are_found_in_lesson_order(tmp_path):
    for n in (10, 2, 1, 9):
        (tmp_path / f"l{n}_smoke.py").touch()
    (tmp_path / "lesson_diff.py").touch()
    assert [p.name for p in pm.discover(tmp_path)] == ["l1_smoke.py", "l2_smoke.py", "l9_smoke.py", "l10_smoke.py"]


def test_every_smoke_in_the_repo_is_in_the_grid():
    assert [p.name for p in pm.discover(ROOT / "scripts")] == sorted(
        (p.name for p in (ROOT / "scripts").glob("l*_smoke.py")), key=lambda n: int(n[1:].split("_")[0]))


def test_a_lesson_without_blocks_runs_once_per_dtype_and_prompt_set():
    l1, l2 = Path("scripts/l1_smoke.py"), Path("scripts/l2_smoke.py")
    cells = pm.grid({l1: False, l2: True}, ["float32", "bfloat16"], ["default", "unicode"], [1, 7, 16])
    assert sum(c.lesson == "L1" for c in cells) == 4 and {c.block_size for c in cells if c.lesson == "L1"} == {None}
    assert sum(c.lesson == "L2" for c in cells) == 12


def test_lessons_on_l8s_block_tables_run_at_the_largest_block_size_only():
    l8, l9, l10 = (Path(f"scripts/l{n}_smoke.py") for n in (8, 9, 10))
    cells = pm.grid({l8: True, l9: True, l10: True}, ["float32", "bfloat16"], ["default"], [1, 7, 16])
    assert {c.block_size for c in cells if c.lesson == "L8"} == {1, 7, 16}
    for lesson in ("L9", "L10"):
        assert sorted((c.dtype, c.block_size) for c in cells if c.lesson == lesson) == [("bfloat16", 16), ("float32", 16)]


def test_l11_runs_at_the_largest_block_size_with_a_drafter_that_drafts_on_every_decode():
    """L11's block sizes are swept by tests/test_l11_invariants.py; its matrix cells check HF parity with drafts."""
    l10, l11 = Path("scripts/l10_smoke.py"), Path("scripts/l11_smoke.py")
    cells = pm.grid({l10: True, l11: True}, ["float32", "bfloat16"], ["default", "unicode"], [1, 7, 16])
    mine = [c for c in cells if c.lesson == "L11"]
    assert sorted((c.dtype, c.prompts, c.block_size) for c in mine) == [
        ("bfloat16", "default", 16), ("bfloat16", "unicode", 16), ("float32", "default", 16), ("float32", "unicode", 16)]
    assert (ROOT / pm.SWEPT_BY_TESTS["L11"]).is_file()
    assert all(c.argv(20, None)[c.argv(20, None).index("--drafter") + 1] == "draft" for c in mine)
    assert all("--drafter" not in c.argv(20, None) for c in cells if c.lesson == "L10")
    help_text = "--block-size BLOCK_SIZE  tokens per KV block (default: 16)"
    assert pm.no_arg_cell(l11, help_text, on_cuda=False) not in mine  # the n-gram no-argument run is another run


def test_a_cell_passes_its_configuration_to_the_smoke():
    cell = pm.Cell("L5", Path("scripts/l5_smoke.py"), "bfloat16", "unicode", 7)
    argv = cell.argv(12, None)
    assert argv[argv.index("--block-size") + 1] == "7" and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--prompt") + 1] == pm.UNICODE_PROMPT and "--json" in argv and "--device" not in argv
    assert "--block-size" not in pm.Cell("L1", Path("scripts/l1_smoke.py"), "float32", "default", None).argv(20, None)


def test_the_unicode_prompt_is_long_and_mixed():
    text = pm.UNICODE_PROMPT
    assert len(text) >= 200 and "東京" in text and "🚀" in text and "é" in text


@pytest.mark.parametrize("argv, wanted", [
    (["--jobs", "0"], "--jobs must be at least 1, got 0"),
    (["--block-sizes", "0,7"], "--block-sizes must be at least 1, got 0"),
    (["--dtypes", "float64"], "--dtypes"),
    (["--prompt-sets", "klingon"], "--prompt-sets"),
    (["--lessons", "l99"], "no smoke script for L99"),
    (["--no-such-option"], "unrecognized arguments"),
])
def test_bad_options_exit_2_with_one_line(argv, wanted, capsys):
    with pytest.raises(SystemExit) as e:
        pm.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and wanted in err and len(err.strip().splitlines()) == 1


def test_the_no_arg_cell_is_what_a_smoke_with_no_arguments_runs():
    """--skip-no-arg-runs (.ci/run) leaves out exactly the cell that `python scripts/lN_smoke.py` computes: the
    smoke's defaults (default prompts, its block size, 20 new tokens, float32 on the CPU), read from its --help."""
    from shared.cli import smoke_parser

    for blocks, size in ((True, 16), (True, 7), (False, None)):
        p = smoke_parser("L2", "d", blocks=blocks, default_prompts=["x"], block_size=size or 16)
        defaults = p.parse_args([])
        cell = pm.no_arg_cell(Path("scripts/l2_smoke.py"), p.format_help(), on_cuda=False)
        assert (cell.lesson, cell.dtype, cell.prompts, cell.block_size) == ("L2", "float32", "default", size)
        assert defaults.dtype is None and defaults.prompt is None and defaults.max_new_tokens == 20  # float32 on cpu
        assert getattr(defaults, "block_size", None) == size
    grid = pm.grid({Path("scripts/l2_smoke.py"): True}, ["float32", "bfloat16"], pm.DEFAULT_PROMPT_SETS, [1, 7, 16])
    assert sum(c == pm.no_arg_cell(Path("scripts/l2_smoke.py"), "--block-size tokens per KV block (default: 16)",
                                   on_cuda=False) for c in grid) == 1
    assert pm.no_arg_cell(Path("scripts/l2_smoke.py"), "", on_cuda=True).dtype == "bfloat16"


def test_skipping_no_arg_runs_needs_the_no_arg_settings(capsys):
    for extra in (["--max-new-tokens", "8"], ["--device", "cpu"]):
        with pytest.raises(SystemExit) as exit_:
            pm.main(["--skip-no-arg-runs", *extra])
        assert exit_.value.code == 2 and "--skip-no-arg-runs" in capsys.readouterr().err


def engines_of(lesson: str) -> set[str]:
    """The engine names a smoke's build_engines returns (its dict keys: "L3": ..., "L2": ...)."""
    import re

    source = (ROOT / "scripts" / f"l{lesson[1:]}_smoke.py").read_text()
    return set(re.findall(r'"(L\d+)":', source[source.index("def build_engines"):]))


def default_prompts_of(lesson: str) -> list[str]:
    import ast

    tree = ast.parse((ROOT / "scripts" / f"l{lesson[1:]}_smoke.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "DEFAULT_PROMPTS")
    return ast.literal_eval(node.value)


def test_a_repeated_cell_is_one_whose_engines_another_row_runs_again():
    """--skip-repeated-runs (.ci/run) leaves out a cell only where the row named in REPEATED_IN runs the lesson's engine
    in the same dtype, prompts and block size, and the lesson's other engines keep their own rows' cells."""
    smokes = {ROOT / "scripts" / f"l{n}_smoke.py": n != 1 for n in range(1, 13)}
    cells = pm.grid(smokes, ["float32", "bfloat16"], pm.DEFAULT_PROMPT_SETS, [1, 7, 16])
    repeats = pm.repeated(cells)
    assert sorted({(c.lesson, c.prompts) for c in repeats}) == [
        ("L1", "default"), ("L2", "unicode"), ("L4", "unicode"), ("L6", "unicode")]
    assert len(repeats) == 1 + 3 * 6  # L1's bf16 default; 3 unicode rows of 2 dtypes x 3 block sizes
    for cell, by in repeats.items():
        assert (by.dtype, by.prompts) == (cell.dtype, cell.prompts) and by not in repeats
        assert cell.block_size in (None, by.block_size)
        assert cell.lesson in engines_of(by.lesson)  # the row after runs this lesson's engine
        for other in engines_of(cell.lesson) - {cell.lesson}:  # and the engine before keeps its own cell
            assert any(c.lesson == other and c.dtype == cell.dtype and c.prompts == cell.prompts
                       and c.block_size in (None, cell.block_size) for c in cells if c not in repeats), (cell, other)
        if cell.prompts == "default":  # the one default cell: only where the two smokes' default prompts are the same
            assert default_prompts_of(cell.lesson) == default_prompts_of(by.lesson)
    assert pm.repeated([c for c in cells if c.lesson != "L3"]).keys() == {c for c in repeats if c.lesson != "L2"}


def test_l13_runs_at_the_largest_block_size_in_both_prompt_sets():
    """L13's mask leaves L12's block tables as they are: 4 cells, like L11's and L12's, one of them the no-argument
    run's (whose 64 tokens hold the cell's 20)."""
    l13 = ROOT / "scripts" / "l13_smoke.py"
    cells = pm.grid({l13: True}, ["float32", "bfloat16"], pm.DEFAULT_PROMPT_SETS, [1, 7, 16])
    assert sorted((c.dtype, c.prompts, c.block_size) for c in cells) == [
        ("bfloat16", "default", 16), ("bfloat16", "unicode", 16), ("float32", "default", 16), ("float32", "unicode", 16)]
    help_text = "--block-size BLOCK_SIZE  tokens per KV block (default: 16)"
    assert pm.no_arg_cell(l13, help_text, on_cuda=False) in cells


def test_a_model_row_passes_the_model_to_every_cell_and_l10_its_ranks():
    """--model smollm2 --tp 3 (.ci/run's real-model row): every cell's command names the model, L10's also --tp 3,
    and no other lesson gets --tp."""
    smokes = {ROOT / "scripts" / f"l{n}_smoke.py": n > 1 for n in (1, 4, 10)}
    cells = pm.grid(smokes, ["float32"], ["chat"], [16], model="smollm2", tp=3)
    for cell in cells:
        argv = cell.argv(20, None)
        assert argv[argv.index("--model") + 1] == "smollm2", argv
        assert (argv[argv.index("--tp") + 1] == "3") if cell.lesson == "L10" else "--tp" not in argv, argv


def test_the_chat_set_is_rendered_by_the_checkpoints_own_template():
    """The embedded checkpoint's template (ChatML, as Qwen3's): each question a user turn, then the assistant's
    turn opened for the answer."""
    prompts = pm.chat_prompts(None)
    assert len(prompts) == len(pm.CHAT_QUESTIONS)
    for question, prompt in zip(pm.CHAT_QUESTIONS, prompts):
        assert f"<|im_start|>user\n{question}<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n"), prompt


def test_l14_runs_at_the_largest_block_size_in_both_prompt_sets():
    """L14's engine is L13's with another matmul: its block tables are L13's, and tests/test_l14_invariance.py sweeps
    what the mode adds. 4 cells, one of them the no-argument run's (which .ci/run's suite has made)."""
    l14 = ROOT / "scripts" / "l14_smoke.py"
    cells = pm.grid({l14: True}, ["float32", "bfloat16"], pm.DEFAULT_PROMPT_SETS, [1, 7, 16])
    assert sorted((c.dtype, c.prompts, c.block_size) for c in cells) == [
        ("bfloat16", "default", 16), ("bfloat16", "unicode", 16), ("float32", "default", 16), ("float32", "unicode", 16)]
    assert pm.no_arg_cell(l14, "--block-size BLOCK_SIZE  tokens per KV block (default: 16)", on_cuda=False) in cells

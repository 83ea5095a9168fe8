"""scripts/benchmark/l13_bench.py at tiny sizes (seconds): one in-process run prints the three sections, the
target line with a verdict and a conditions line its own planned() agrees with; its constrained outputs are
valid prefixes of the schema, masked once per row; a grammar that ends within the timed steps stops the
benchmark, and the output it ended is JSON that validates. No timings are asserted."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import harness  # noqa: E402
from shared.errors import CourseError  # noqa: E402

SCRIPT = ROOT / "scripts" / "benchmark" / "l13_bench.py"
TINY = ["--batches", "1,2", "--prompt-len", "8", "--steps", "3", "--string-length", "100", "--rounds", "1",
        "--compile-rounds", "1"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("l13_bench_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_run(bench, tmp_path_factory, tiny_model, grammar_compiler):
    out = tmp_path_factory.mktemp("l13") / "l13.json"
    stdout = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # the session's model and compiler (the same files): the benchmark's own loads would cost seconds
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr(bench.Qwen3ForCausalLM, "from_dir", lambda *args, **kwargs: tiny_model)
        patch.setattr(bench, "GrammarCompiler", lambda *args, **kwargs: grammar_compiler)
        try:
            bench.main([*TINY, "--json", str(out)])
        finally:
            torch.set_num_threads(threads)
    return stdout.getvalue(), json.loads(out.read_text())


def test_the_run_prints_three_sections_a_target_and_conditions(bench, tiny_run):
    stdout, report = tiny_run
    assert "a. decode: embedded model, fp32" in stdout and "b. the mask per decode step" in stdout
    assert "c. compiling" in stdout
    targets = [line for line in stdout.splitlines() if line.startswith("target: ")]
    assert len(targets) == 1 and "not measured" in targets[0]  # batch 16 was not run: said so, not a verdict
    line = next(x for x in stdout.splitlines() if x.startswith("conditions" + harness.SEP))
    fields = harness.parse_line(line)
    assert report["conditions_line"] == line
    plan = bench.planned(bench.parser().parse_args(TINY), {"OMP_NUM_THREADS": "1"}, "cpu")
    assert {k: fields[k] for k in plan} == plan  # what the doc test will compare a pasted table with
    assert (fields["steps"], fields["string"]) == ("3", "100")
    schemas = [r["schema"] for r in report["compile"]]
    assert schemas[0].startswith("tokenizer") and len(schemas) == 5 and schemas[-1] == "string of 100"


def test_every_decode_row_is_measured_and_constrained_rows_are_masked_once(tiny_run):
    _, report = tiny_run
    rows = report["decode"]
    assert [(r["batch"], r["system"]) for r in rows] == [(b, s) for b in (1, 2) for s in ("unconstrained", "constrained")]
    for r in rows:
        assert r["steps"] == 3  # every decode step timed, none after a request ended
        if r["system"] == "constrained":
            assert r["masked_rows"] == 3 * r["batch"]  # one mask per decode row, none twice
            assert 0 < r["fill_s"] + r["apply_s"] <= r["mask_s"]
            assert all(text.startswith('{"text":"') for text in r["outputs"])
        else:
            assert r["masked_rows"] == 0 and r["mask_s"] == 0 and r["ratio"] == 1


def test_constrained_outputs_validate_and_an_early_end_stops_the_benchmark(bench, tiny_model, tokenizer,
                                                                          grammar_compiler):
    from lessons.l13_structured.grammar import GrammarSpec

    schema = bench.long_string_schema(4)
    grammar = grammar_compiler.compile(GrammarSpec("json_schema", schema))
    prompts = [[100 + i] * 6 for i in range(2)]
    run = bench.Run(tiny_model, prompts, 40, grammar)
    with torch.inference_mode():
        while run.engine.scheduler.has_work():
            run.step()
    outputs = run.result()["outputs"]
    for ids in outputs:  # each ended at its grammar's EOS, long before the 41-token budget
        assert ids[-1] in grammar.eos_ids and len(ids) < 41
        text = tokenizer.decode([t for t in ids if t not in grammar.eos_ids])
        jsonschema.validate(json.loads(text), schema)
        assert len(json.loads(text)["text"]) == 4
    with pytest.raises(CourseError, match="ended after"):
        bench.check_constrained(outputs, grammar, tokenizer, 40)
    bench.check_constrained([ids[:5] for ids in outputs], grammar, tokenizer, 4)  # a prefix passes
    with pytest.raises(CourseError, match="left its grammar"):
        bench.check_constrained([tokenizer.encode("hello").ids], grammar, tokenizer, 0)


def test_a_bad_option_is_one_line(bench, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--rounds", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().startswith("error: ") and len(err.splitlines()) == 1

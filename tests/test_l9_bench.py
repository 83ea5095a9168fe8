"""scripts/benchmark/l9_bench.py's --curve: the levels and requests it plans, and where it says a server
saturates. (The run itself starts two servers for minutes: a benchmark, not a test.)"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "benchmark"))
import l9_bench  # noqa: E402


def plan(*argv: str):
    args = l9_bench.parser().parse_args(list(argv))
    return args, l9_bench.settings(args)


def test_the_curve_plans_1_to_64_clients_each_sending_at_least_twice():
    args, specs = plan("--curve", "--only", "ours")
    assert [s.concurrency for s in specs] == [1, 2, 4, 8, 16, 32, 64]
    assert [s.num_requests for s in specs] == [16, 16, 16, 16, 32, 64, 128]
    assert all(s.output_len == (16, 32) and s.input_len == (32, 256) for s in specs)
    assert args.num_blocks == 64 * 19 + 1  # every request of 64 clients at once: (256 + 16 + 32) / 16 blocks each
    _, specs = plan("--curve", "--only", "ours", "--num-requests", "5", "--output-len", "8-8")
    assert [s.num_requests for s in specs] == [5] * 7 and specs[0].output_len == (8, 8)
    _, specs = plan("--only", "ours")  # the default run is unchanged
    assert [(s.concurrency, s.num_requests, s.output_len) for s in specs] == [(8, 64, (16, 64)), (32, 64, (16, 64))]


@pytest.mark.parametrize("argv, message", [
    (("--curve", "--quick"), "--quick and --curve are two different runs: pick one"),
    (("--png", "x.png"), "--png draws the --curve run: add --curve"),
    (("--curve", "--num-requests", "0"), "--num-requests must be at least 1, got 0"),
])
def test_contradictory_options_are_refused_before_any_server_starts(argv, message):
    with pytest.raises(l9_bench.CourseError, match=message):
        plan(*argv, "--only", "ours")


def test_a_server_saturates_at_the_fewest_clients_reaching_90_percent_of_its_best():
    def row(c: int, ours: float, hf: float) -> dict:
        return {"concurrency": c, "servers": {"ours": {"output tok/s": ours, "TTFT p99": 10.0 * c},
                                              "HF": {"output tok/s": hf, "TTFT p99": 20.0 * c}}}

    rows = [row(1, 50, 40), row(2, 90, 70), row(4, 181, 100), row(8, 200, 99), row(16, 195, 101)]
    curve = l9_bench.curve_summary(rows, ["ours", "HF"])
    assert curve["ours"]["best_output_tok_s"] == 200 and curve["ours"]["saturates_at"] == 4  # 181 >= 180
    assert curve["HF"]["best_output_tok_s"] == 101 and curve["HF"]["saturates_at"] == 4  # 100 >= 90.9
    assert [p["ttft_p99_ms"] for p in curve["HF"]["points"]] == [20, 40, 80, 160, 320]


def test_planned_names_what_the_servers_run_for_the_doc_test():
    """tests/test_doc_measured.py compares this with a quoted conditions line: threads from --threads, our
    backend and dtype as serve.py would resolve them from --ours-args, HF's server alone names no backend of ours."""
    harness = l9_bench.harness
    plan = l9_bench.planned(l9_bench.parser().parse_args([]), {"OMP_NUM_THREADS": "1"}, "cpu")
    assert plan == {"device": "cpu", "dtype": "float32", "backend": harness.resolve_backend("auto"), "threads": "1"}
    args = l9_bench.parser().parse_args(["--threads", "2", "--ours-args=--backend torch --dtype bfloat16"])
    plan = l9_bench.planned(args, {}, "cpu")
    assert (plan["threads"], plan["dtype"]) == ("2", "bfloat16")
    assert plan["backend"] == harness.resolve_backend("torch", "cpu", harness.torch.bfloat16)
    assert l9_bench.planned(l9_bench.parser().parse_args(["--only", "peer"]), {}, "cpu")["backend"] == "HF"

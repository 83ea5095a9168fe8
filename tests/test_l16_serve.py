"""scripts/serve.py --weights (L16): the options blocks cannot run with are refused in one line before anything
loads, and a server on the embedded model with --weights q4_1, built by serve.py's own build() and called in process
through its ASGI app, answers a completion with L16Engine's tokens on the same Q4_1 model."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lessons.l16_weight_quant import L16Engine  # noqa: E402
from lessons.l16_weight_quant.weights import quantized_model, weights_of  # noqa: E402
from scripts import serve  # noqa: E402
from shared.config import Qwen3Config  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.server_process import SERVE  # noqa: E402
from test_l3_cpp_backend import needs_kernel  # noqa: E402

TIMEOUT = 60.0  # every wait: a bug fails the test, it never hangs it
PROMPT = "The capital of France is"

REFUSED = {
    ("--weights", "q4_1", "--dtype", "bfloat16"):
        "--weights q4_1 multiplies fp32 activations (the kernel dequantizes to fp32): leave --dtype out or use "
        "float32, not bfloat16",
    ("--weights", "q8_0", "--dtype", "float16"):
        "--weights q8_0 multiplies fp32 activations (the kernel dequantizes to fp32): leave --dtype out or use "
        "float32, not float16",
    ("--weights", "q8_0", "--device", "cuda"):
        "--weights q8_0 runs on the CPU (the block kernel is C++), not --device cuda",
    ("--weights", "q4_1", "--tp", "2"):
        "--weights q4_1 runs at --tp 1, not 2: the block kernel serves one process's whole matrices, not a rank's "
        "slices",
    ("--weights", "fp32", "--dtype", "bfloat16"): "--weights fp32 computes in float32; --dtype bfloat16 contradicts it",
    ("--weights", "bf16", "--dtype", "float32"): "--weights bf16 computes in bfloat16; --dtype float32 contradicts it",
}


@pytest.mark.task("L16.5")
@pytest.mark.parametrize("argv", list(REFUSED), ids=lambda a: "-".join(x.strip("-") for x in a))
def test_a_setup_blocks_cannot_run_is_refused_before_anything_loads(argv, monkeypatch):
    def no_loading(*_args, **_kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(serve.Qwen3ForCausalLM, "from_dir", no_loading)
    monkeypatch.setattr(serve, "resolve_model_dir", no_loading)
    with pytest.raises(CourseError) as refused:
        serve.build(serve.parser().parse_args([*argv, "--port", "0"]))
    assert str(refused.value) == REFUSED[argv]


def test_the_refusal_is_one_line_with_exit_2():
    argv = ("--weights", "q4_1", "--dtype", "bfloat16")
    r = subprocess.run([sys.executable, str(SERVE), *argv, "--port", "0"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"error: {REFUSED[argv]}\n")


@pytest.mark.parametrize("weights,dtype", [("fp32", "float32"), ("bf16", "bfloat16"), (None, None)])
def test_fp32_and_bf16_name_the_dtype_and_no_flag_leaves_it_alone(weights, dtype):
    args = serve.parser().parse_args([] if weights is None else ["--weights", weights])
    serve.check_weights_options(args)
    assert (args.dtype, args.device) == (dtype, "auto")


@needs_kernel
def test_a_q4_1_server_answers_with_the_engines_tokens(tiny_model, tokenizer, tiny_dir):
    server, sock = serve.build(serve.parser().parse_args(["--weights", "q4_1", "--port", "0"]))
    loop = server.engine_loop
    try:
        assert isinstance(loop.engine, L16Engine) and weights_of(loop.engine.model) == "q4_1"
        ids = tokenizer.encode(PROMPT).ids
        eos = frozenset(Qwen3Config.from_dir(tiny_dir).eos_token_ids)
        expected = L16Engine(quantized_model(tiny_model, "q4_1"), 16).generate_batch([ids], StopRule(8, eos, True))[0]
        dense = Qwen3ForCausalLM.from_dir(tiny_dir, tiny_model.lm_head.weight.dtype, "cpu")
        assert expected != L16Engine(dense, 16).generate_batch([ids], StopRule(8, eos, True))[0]  # q4_1 is seen

        async def ask() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(server.config.app), base_url="http://test",
                                         timeout=TIMEOUT) as client:
                return await client.post("/v1/completions", json={
                    "model": "tiny-qwen3-v3", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})

        loop.start()
        response = asyncio.run(ask())
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == expected
    finally:
        loop.stop(TIMEOUT)
        loop.engine.close()
        sock.close()

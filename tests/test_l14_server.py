"""L14 through the server: `scripts/serve.py --batch-invariant` says so in its engine line, and a seeded request
samples the same tokens alone and among concurrent requests (its logits are the same bits, so its draws pick the
same tokens); greedy answers are HF's. --tp 2 with the mode is refused in one line, exit 2, before any rank starts."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import openai
import pytest

from shared.config import Qwen3Config
from shared.generation import StopRule
from shared.server_process import SERVE, ServerProcess

TIMEOUT = 120
NEEDLE = "A batch-invariant server answers"
OTHERS = ["The capital of France is", "def fibonacci(n):", "Hello, world!", "Once upon a time", "1, 2, 3,"]


async def complete(url: str, model: str, requests: list[dict]) -> list[list[int]]:
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
        async def one(kwargs: dict) -> list[int]:
            r = await client.completions.create(model=model, max_tokens=12, **kwargs,
                                                extra_body={"return_token_ids": True, "ignore_eos": True,
                                                            **kwargs.pop("extra_body", {})})
            return r.choices[0].model_extra["token_ids"]

        return await asyncio.gather(*(one(dict(r)) for r in requests))


@pytest.mark.slow  # a server start; the mode itself is tests/test_l14_invariance.py's
def test_a_seeded_request_samples_the_same_alone_and_in_a_crowd(tokenizer, hf, tiny_dir):
    needle = {"prompt": NEEDLE, "temperature": 1.0, "seed": 7}
    crowd = [{"prompt": p, "temperature": 1.0, "seed": i} for i, p in enumerate(OTHERS)]
    server = ServerProcess(["--batch-invariant"]).start()
    try:
        assert "· batch-invariant" in server.log_text()
        alone = asyncio.run(complete(server.url, server.model, [needle]))[0]
        together = asyncio.run(complete(server.url, server.model, crowd[:3] + [needle] + crowd[3:]))
        greedy = asyncio.run(complete(server.url, server.model, [{"prompt": NEEDLE, "temperature": 0}]))[0]
    finally:
        status = server.stop()
    assert together[3] == alone
    eos = frozenset(Qwen3Config.from_dir(tiny_dir).eos_token_ids)
    assert greedy == hf.generate(tokenizer.encode(NEEDLE).ids, StopRule(12, eos, ignore_eos=True)).tokens
    assert status == 0, server.stderr_tail()


def test_the_mode_with_tensor_parallel_ranks_is_refused_in_one_line():
    r = subprocess.run([sys.executable, str(SERVE), "--batch-invariant", "--tp", "2", "--port", "0"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: --batch-invariant runs at --tp 1, not 2: ranks that split a matmul add their "
                                "partial sums in another order than one rank does")

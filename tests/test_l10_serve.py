"""L10 through L9's server: `scripts/serve.py --tp 2` answers completions with HF's tokens (computed here, for
each prompt alone), streamed or not, several at once; SIGTERM ends rank 0 with status 0 and its follower with it.
A follower killed under a live server turns the next request into a 503 naming the failure, never a hang; a
server idle for longer than the step timeout keeps its follower and answers the next request."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from shared.server_process import ServerProcess
from shared.config import Qwen3Config
from shared.generation import StopRule

# Slow (servers on two ranks, a follower killed and one left idle past its timeout).
pytestmark = pytest.mark.slow

TIMEOUT = 120
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hello, world!"]


def children(pid: int) -> list[int]:
    """Live child processes of pid, from /proc (a spawned follower, multiprocessing's resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def follower_of(pid: int) -> int:
    for child in children(pid):
        if b"multiprocessing.spawn" in Path(f"/proc/{child}/cmdline").read_bytes():
            return child
    raise AssertionError(f"serve.py (pid {pid}) has no spawned follower")


def blocks_held(url: str) -> int:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=TIMEOUT).text
    return int(float(re.search(r"^paged_blocks_held (\S+)$", text, re.M).group(1)))


async def complete_all(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
        async def one(ids: list[int], stream: bool) -> list[int]:
            kwargs = dict(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                          extra_body={"return_token_ids": True, "ignore_eos": True})
            if not stream:
                r = await client.completions.create(**kwargs)
                return r.choices[0].model_extra["token_ids"]
            tokens: list[int] = []
            async for chunk in await client.completions.create(**kwargs, stream=True):
                for c in chunk.choices:
                    tokens += c.model_extra.get("token_ids") or []
            return tokens

        return await asyncio.gather(*(one(ids, i % 2 == 0) for i, ids in enumerate(prompts)))


def test_serve_tp2_answers_with_hfs_tokens_and_stops_with_its_follower(tokenizer, hf, tiny_dir):
    ids = [tokenizer.encode(p).ids for p in PROMPTS]
    eos = frozenset(Qwen3Config.from_dir(tiny_dir).eos_token_ids)
    server = ServerProcess(["--tp", "2"]).start()
    try:
        follower = follower_of(server.proc.pid)
        held_before = blocks_held(server.url)  # L7's dummy block, held for good
        got = asyncio.run(complete_all(server.url, server.model, ids, 8))
        deadline = time.monotonic() + 30
        while (held := blocks_held(server.url)) != held_before and time.monotonic() < deadline:
            time.sleep(0.1)  # the metrics are refreshed after the engine's step, a moment after the last answer
    finally:
        status = server.stop()
    for prompt, tokens in zip(ids, got):
        assert tokens == hf.generate(prompt, StopRule(8, eos, ignore_eos=True)).tokens
    assert held == held_before  # every request's blocks went back (prefix blocks stay cached, unheld)
    assert status == 0, server.stderr_tail()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{follower}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # the follower was told to stop; a zombie entry may linger until reaped
    assert not Path(f"/proc/{follower}").exists() or "Z" in Path(f"/proc/{follower}/stat").read_text().split()[2]


def test_a_dead_follower_fails_requests_with_503_not_a_hang(tokenizer):
    server = ServerProcess(["--tp", "2", "--tp-timeout", "10"]).start()
    try:
        os.kill(follower_of(server.proc.pid), signal.SIGKILL)
        t0 = time.monotonic()
        with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(model=server.model, prompt=tokenizer.encode("Hi").ids, max_tokens=4)
        assert time.monotonic() - t0 < 60  # a hang guard, not a timing claim: the failure is seen at the broadcast
        assert err.value.status_code == 503 and "RunFailure" in err.value.message and "rank 0 of 2" in err.value.message
        assert httpx.get(server.url.removesuffix("/v1") + "/health", timeout=TIMEOUT).status_code == 503
    finally:
        server.stop()
    assert "error: tensor-parallel rank 0 of 2" in server.stderr_tail(20) and "Traceback" not in server.stderr_tail(20)


def test_a_server_idle_longer_than_the_step_timeout_keeps_its_follower(tokenizer, hf, tiny_dir):
    """Waiting for work is not a stalled step: a follower waits for the next step without a timeout, so a
    server idle for longer than --tp-timeout still has its follower and answers with HF's tokens."""
    ids = tokenizer.encode(PROMPTS[0]).ids
    eos = frozenset(Qwen3Config.from_dir(tiny_dir).eos_token_ids)
    server = ServerProcess(["--tp", "2", "--tp-timeout", "2"]).start()
    try:
        follower = follower_of(server.proc.pid)
        time.sleep(5)  # idle for more than twice the step timeout
        [got] = asyncio.run(complete_all(server.url, server.model, [ids], 6))
        alive = [Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
                 for pid in (server.proc.pid, follower)]
    finally:
        status = server.stop()
    assert got == hf.generate(ids, StopRule(6, eos, ignore_eos=True)).tokens
    assert alive == [True, True]
    assert status == 0, server.stderr_tail()

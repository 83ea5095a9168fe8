"""L12 through L9's server: `scripts/serve.py --kv-dtype int8` serves from int8 KV pages.

int8 KV is not fp32's exact tokens (docs/l12_kv_quant.md: the quality contract is measured teacher-forced,
not by parity), so the reference here is the int8 engine itself, in process: for each prompt alone, greedy,
the server's tokens (whole and streamed) equal what L12Engine with kv_dtype="int8" and the server's settings
generates. A second server adds `--speculative draft` (the model drafting for itself): a token's int8 row is
the same whichever step writes it, so verify steps give the same tokens as plain decodes. Also: the pool is
sized in bytes (more blocks than the default fp32 pool, as /metrics and the `engine:` line report), /metrics
shows speculation counters only where a drafter drafts, and bad values exit 2 with one line.
"""
from __future__ import annotations

import json
import sys

import httpx
import pytest
import torch

from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING
from lessons.l12_kv_quant import L12Engine
from shared.generation import StopRule
from shared.server_process import SERVE, ServerProcess, servers_running

sys.path.insert(0, str(SERVE.parent))
from serve import SERVER_MAX_BATCHED_TOKENS  # noqa: E402

SERVERS = {
    "int8": ["--kv-dtype", "int8"],
    "int8-draft": ["--kv-dtype", "int8", "--speculative", "draft", "--num-speculative-tokens", "4"],
}
# The last prompt spans several 16-token blocks, so decodes read more than one int8 page.
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Paged attention stores the key/value cache in "
           "fixed-size blocks, so memory is allocated on demand instead of reserved for the longest sequence."]
MAX_TOKENS = 16
FP32_DEFAULT_BLOCKS = 4096 // 16  # the default pool of every earlier server: 4096 tokens in blocks of 16
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def servers():
    """All start in parallel; at the end each is stopped with SIGTERM and must exit 0."""
    with servers_running(SERVERS) as started:
        yield started


@pytest.fixture(scope="module")
def int8_engine(tiny_model):
    """The server's engine, built in process: int8 pages, the default pool bytes, the server's token budget."""
    return L12Engine(tiny_model, 16, None, DEFAULT_MAX_RUNNING, "auto", kv_dtype="int8",
                     max_batched_tokens=SERVER_MAX_BATCHED_TOKENS)


@pytest.fixture(scope="module")
def engine_outputs(int8_engine, tokenizer, tiny_model) -> dict[str, list[int]]:
    """Greedy tokens of each prompt run alone on the in-process int8 engine (one thread, as the servers run)."""
    eos = frozenset(tiny_model.config.eos_token_ids)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {p: int8_engine.generate_batch([tokenizer.encode(p).ids], StopRule(MAX_TOKENS, eos, False))[0]
                for p in PROMPTS}
    finally:
        torch.set_num_threads(threads)


def complete(proc: ServerProcess, prompt: str, stream: bool) -> tuple[list[int], str, str]:
    """One greedy completion, whole or streamed: (token ids, text, finish reason)."""
    body = {"model": proc.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "return_token_ids": True}
    if not stream:
        choice = httpx.post(proc.url + "/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
        return choice["token_ids"], choice["text"], choice["finish_reason"]
    tokens, text, finish = [], "", None
    with httpx.stream("POST", proc.url + "/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                tokens += c.get("token_ids") or []
                text += c["text"]
                finish = c["finish_reason"] or finish
    return tokens, text, finish


def metrics_of(proc: ServerProcess) -> dict[str, float]:
    text = httpx.get(proc.url.removesuffix("/v1") + "/metrics", timeout=TIMEOUT).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("paged_") and not line.split()[0].endswith("_created")}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("name", list(SERVERS))
def test_greedy_output_equals_the_int8_engines_own(servers, engine_outputs, tokenizer, name, stream):
    """Each prompt alone (one request at a time): the tokens equal the in-process int8 engine's, the text is
    their decode, the finish reason is the engine's (length unless it stopped on an end-of-sequence token)."""
    for prompt in PROMPTS:
        tokens, text, finish = complete(servers[name], prompt, stream)
        want = engine_outputs[prompt]
        assert tokens == want, (name, prompt)
        assert text == tokenizer.decode(want, skip_special_tokens=True), (name, prompt)
        assert finish == ("length" if len(want) == MAX_TOKENS else "stop"), (name, prompt)


def test_the_pool_is_sized_in_bytes_and_the_engine_line_says_int8(servers, int8_engine):
    """The int8 pool holds the default pool's bytes: the in-process engine's block count, several times the fp32
    default's (4 bytes a value against 1, less the scales' share); /metrics' three block gauges add up to it and the
    `engine:` line names it. Speculation counters appear on the drafting server only."""
    assert int8_engine.allocator.num_blocks > 3 * FP32_DEFAULT_BLOCKS
    for name, proc in servers.items():
        m = metrics_of(proc)
        assert sum(m[f"paged_blocks_{k}"] for k in ("free", "cached", "held")) == int8_engine.allocator.num_blocks
        engine = proc.engine()
        assert {"backend", "threads", "device", "dtype"} <= set(engine), engine
        assert (engine["kv-dtype"], engine["kv-blocks"]) == ("int8", str(int8_engine.allocator.num_blocks)), engine
    assert not [k for k in metrics_of(servers["int8"]) if "spec" in k]
    assert metrics_of(servers["int8-draft"])["paged_spec_draft_tokens_total"] > 0


def test_bad_kv_dtype_values_exit_2_with_one_line(monkeypatch, capsys):
    """An unknown --kv-dtype, and int8 pages with a backend that cannot read them: exit 2 and one line, before
    anything loads (serve.py's main, in process)."""
    import serve

    for args in (["--kv-dtype", "int4"], ["--kv-dtype", "int8", "--backend", "batched"]):
        monkeypatch.setattr(sys, "argv", ["serve.py", "--port", "0", *args])
        with pytest.raises(SystemExit) as exit_:
            serve.main()
        out, err = capsys.readouterr()
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), (args, err)
        assert out == "", args

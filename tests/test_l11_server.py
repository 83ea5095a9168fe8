"""L11 through L9's server: `scripts/serve.py --speculative ngram|draft` streams exactly what the server without
speculation streams (text, tokens, finish reasons, usage), even though a step may now carry several tokens.

Three servers, started at once (each takes seconds to load): `plain` (L9's engine), `ngram` (prompt lookup,
which on the embedded random-weight model finds something to propose only in the smoke's self-repeating
prompt) and `draft` (the embedded model drafting for itself with K = 4: it guesses what it will say, so nearly
every draft is kept and most steps bring five tokens; that is what makes the several-tokens-per-step paths
really run).
Covered: greedy streams against the plain server's; a stop string that completes in the middle of a step's
accepted drafts ends the text, the tokens and the usage where the plain server ends them; the detokenizer
gives the same text one token at a time as in one call (why the engine thread may feed a step's tokens either
way); /metrics counts drafts, kept drafts and the mean accepted length on a speculative server only; the
`engine:` line names the speculation; flags that cannot mean anything exit 2 with one line.
"""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest

from lessons.l9_server.detokenizer import IncrementalDetokenizer, TokenBytes
from lessons.l9_server.engine_loop import Choice, EngineLoop
from lessons.l9_server.stop_strings import StopStringMatcher
from shared.server_process import SERVE, ServerProcess, servers_running

sys.path.insert(0, str(SERVE.parent))
from l11_smoke import REPEAT  # noqa: E402  (the smoke's prompt in which the n-gram drafter finds a match)

K = 4
SERVERS = {
    "plain": [],
    "ngram": ["--speculative", "ngram", "--num-speculative-tokens", str(K)],
    "draft": ["--speculative", "draft", "--num-speculative-tokens", str(K)],
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Emoji 🚀🔥 and 東京の桜", REPEAT]
MAX_TOKENS = 24
TIMEOUT = 60.0  # every client call: a server bug fails the test, it never hangs it
FIRST_ADDED = 151643  # BPE ranks end here; the special tokens follow


# --- the servers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers():
    """All start in parallel; at the end each is stopped with SIGTERM and must exit 0."""
    with servers_running(SERVERS) as started:
        yield started


@dataclass
class Streamed:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)  # each chunk's tokens: one engine step's Delta each
    finishes: list[str] = field(default_factory=list)
    usage: dict | None = None


async def stream(client: httpx.AsyncClient, proc: ServerProcess, prompt: str, **fields) -> Streamed:
    """One greedy streamed completion, read as raw SSE (with the tokens of each chunk and the usage chunk)."""
    body = {"model": proc.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}, **fields}
    out = Streamed()
    async with client.stream("POST", proc.url + "/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                out.usage = chunk["usage"]
            for c in chunk["choices"]:
                out.text += c["text"]
                out.tokens += c.get("token_ids") or []
                out.steps.append(c.get("token_ids") or [])
                if c["finish_reason"]:
                    out.finishes.append(c["finish_reason"])
    return out


def stream_all(servers: dict[str, ServerProcess], names, prompts: list[str], **fields) -> dict[str, list[Streamed]]:
    """Every prompt on every named server, all at once (a speculative server verifies them in one batch)."""
    async def main():
        async with httpx.AsyncClient() as client:
            runs = [[stream(client, servers[name], p, **fields) for p in prompts] for name in names]
            done = await asyncio.gather(*(r for row in runs for r in row))
        return {name: done[i * len(prompts):(i + 1) * len(prompts)] for i, name in enumerate(names)}

    return asyncio.run(main())


def metrics_of(proc: ServerProcess) -> dict[str, float]:
    text = httpx.get(proc.url.removesuffix("/v1") + "/metrics", timeout=TIMEOUT).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("paged_") and not line.split()[0].endswith("_created")}


def idle_metrics(proc: ServerProcess, timeout: float = 20.0) -> dict[str, float]:
    """/metrics once nothing runs or waits: the engine thread publishes them just after a step's last answer."""
    deadline = time.monotonic() + timeout
    while (m := metrics_of(proc))["paged_requests_running"] or m["paged_requests_waiting"]:
        assert time.monotonic() < deadline, f"{proc.label} still busy: {m}"
        time.sleep(0.02)
    return m


@pytest.fixture(scope="module")
def streams(servers) -> dict[str, list[Streamed]]:
    return stream_all(servers, SERVERS, PROMPTS)


# --- the streams ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_streamed_text_with_speculation_equals_streamed_text_without(streams, name):
    """Text, tokens, finish reason and usage of every prompt: the speculative server's equal the plain one's.
    The draft server's steps really carry several tokens (chunks of K + 1 tokens)."""
    for prompt, plain, spec in zip(PROMPTS, streams["plain"], streams[name]):
        assert (spec.text, spec.tokens, spec.finishes, spec.usage) == \
               (plain.text, plain.tokens, plain.finishes, plain.usage), prompt
        assert plain.usage["completion_tokens"] == len(plain.tokens) > 0
    if name == "draft":  # K drafts kept + the target's own: K + 1 per step (more only if a lagging reader's merged)
        assert all(max(map(len, s.steps)) >= K + 1 for s in streams[name])


def stop_inside_a_step(token_bytes: TokenBytes, plain: Streamed, steps: list[list[int]]) -> tuple[str, int]:
    """A stop string whose first occurrence in the plain text completes at a token that is neither the first
    nor the last of its step in `steps` (so the step brought tokens before it and after it), and that releases
    text of its own. Returns (stop string, tokens up to and including the one that completes it)."""
    detok, ends = IncrementalDetokenizer(token_bytes), []
    for token in plain.tokens:  # where the text stands after each token, pushed one at a time as L9 does
        ends.append((ends[-1] if ends else 0) + len(detok.push([token])))
    assert ends[-1] <= len(plain.text)
    start = 0
    for step in steps:
        for j in range(start + 1, start + len(step) - 1):  # inside the step: tokens before and after it
            if ends[j] == ends[j - 1]:
                continue  # this token completes no character: it cannot complete a stop string
            for length in range(2, 7):
                stop = plain.text[max(0, ends[j] - length):ends[j]]
                if stop.strip() == stop and plain.text.find(stop) == ends[j] - len(stop) and len(stop) == length:
                    return stop, j + 1
        start += len(step)
    pytest.fail("no token inside a multi-token step releases text that can end a first-occurrence stop string")


def test_a_stop_string_inside_accepted_drafts_cuts_where_the_plain_server_does(servers, streams, tokenizer):
    """A stop string that completes at a token in the middle of a draft step: every server ends the text just
    before it, with the tokens up to that one (not the rest of the step) and a usage that counts them, finish
    "stop"; the draft server's last chunk carried several tokens (the stop really landed inside a step)."""
    plain = streams["plain"][0]
    stop, used = stop_inside_a_step(TokenBytes(tokenizer), plain, streams["draft"][0].steps)
    got = stream_all(servers, SERVERS, [PROMPTS[0]], stop=[stop])
    want_text = plain.text[:plain.text.find(stop)]
    for name, [run] in got.items():
        assert (run.text, run.tokens, run.finishes) == (want_text, plain.tokens[:used], ["stop"]), name
        assert run.usage["completion_tokens"] == used, name
    assert len(got["draft"][0].steps[-1]) > 1 and used < len(plain.tokens)
    whole = httpx.post(servers["draft"].url + "/completions", timeout=TIMEOUT, json={
        "model": servers["draft"].model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
        "stop": [stop], "return_token_ids": True}).json()
    assert whole["choices"][0]["text"] == want_text and whole["choices"][0]["token_ids"] == plain.tokens[:used]
    assert whole["usage"]["completion_tokens"] == used and whole["choices"][0]["finish_reason"] == "stop"


def test_metrics_count_drafts_on_a_speculative_server_only(servers, streams):
    """After the streams: the draft server counted verify rows, draft tokens and kept drafts (the model
    drafting for itself keeps nearly all), and its mean accepted length is 1 + kept / rows; the n-gram server
    counted the drafts it found in the self-repeating prompt; the plain server shows none."""
    m = idle_metrics(servers["draft"])
    drafts, drafted = m["paged_spec_drafts_total"], m["paged_spec_draft_tokens_total"]
    accepted = m["paged_spec_accepted_tokens_total"]
    assert drafts > 0 and drafted >= drafts and 0.9 * drafted <= accepted <= drafted
    assert m["paged_spec_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    ngram = idle_metrics(servers["ngram"])
    assert ngram["paged_spec_draft_tokens_total"] >= ngram["paged_spec_drafts_total"] > 0
    assert ngram["paged_spec_accepted_tokens_total"] <= ngram["paged_spec_draft_tokens_total"]
    assert not [k for k in idle_metrics(servers["plain"]) if "spec" in k]


def test_the_engine_line_names_the_speculation(servers, tiny_dir):
    """The `engine:` line keeps the fields a benchmark reads (backend, threads, device, dtype) and adds the
    drafter and K; a draft server without --draft-model says it drafts with the target's own checkpoint."""
    engines = {name: proc.engine() for name, proc in servers.items()}
    for engine in engines.values():
        assert {"backend", "threads", "device", "dtype"} <= set(engine) and engine["threads"] == "1"
    assert "speculative" not in engines["plain"]
    assert engines["ngram"]["speculative"] == f"ngram k={K}"
    assert engines["draft"]["speculative"] == f"draft k={K}"
    assert engines["draft"]["draft-model"] == f"{tiny_dir} (the target's own checkpoint)"


# --- the engine thread's pieces, in process ----------------------------------------------------------------


def random_stream(rng: random.Random, tokenizer) -> list[int]:
    """Token ids of text full of characters that BPE splits across tokens, mixed with random BPE ids (which
    may form bytes that are no UTF-8 at all, each shown as U+FFFD once certain)."""
    ids: list[int] = []
    for _ in range(rng.randrange(1, 6)):
        if rng.random() < 0.5:
            text = "".join(rng.choice("é東京語🙂🚀ab ∑€한") for _ in range(rng.randrange(1, 8)))
            ids += tokenizer.encode(text).ids
        else:
            ids += [rng.randrange(FIRST_ADDED) for _ in range(rng.randrange(1, 4))]
    return ids


def test_the_detokenizer_gives_the_same_text_one_token_at_a_time_as_in_one_call(tokenizer):
    """300 seeded streams: pushed one token at a time or all at once, the same text and the same held bytes
    (so a step's tokens may be fed either way); and that text is the tokenizer's own decode."""
    token_bytes, rng = TokenBytes(tokenizer), random.Random(11)
    for _ in range(300):
        ids = random_stream(rng, tokenizer)
        one, each = IncrementalDetokenizer(token_bytes), IncrementalDetokenizer(token_bytes)
        whole = one.push(ids)
        pieces = "".join(each.push([t]) for t in ids)
        assert (pieces, each.held) == (whole, one.held), ids
        assert pieces + each.flush() == whole + one.flush() == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_steps_tokens_stop_at_the_token_that_completes_a_stop_string(tokenizer):
    """EngineLoop._text_of on one step of several tokens, for a stop string ending at each token in turn:
    the text and the tokens used are what the same tokens give one per step (the reference here), never the
    whole step; with no stop string the whole step goes out in one call."""
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode("Hello wörld, 東京 is 🙂 far from here").ids
    for j in range(len(ids)):
        ref_detok, texts = IncrementalDetokenizer(token_bytes), []
        for t in ids:
            texts.append(ref_detok.push([t]))
        upto = "".join(texts[:j + 1])
        if not texts[j] or "".join(texts).find(upto[-2:]) != len(upto) - len(upto[-2:]):
            continue  # token j completes no character, or its last two characters appear earlier
        stop = upto[-2:]
        for split in range(len(ids)):  # the step starts anywhere before or at j's token, or after it
            choice = Choice(None, IncrementalDetokenizer(token_bytes), StopStringMatcher((stop,)))
            before, step = ids[:split], ids[split:]
            head = "" if not before else EngineLoop._text_of(choice, before)[0]
            text, used = EngineLoop._text_of(choice, step)
            if split > j:
                assert choice.stops.stopped  # an earlier step of one token at a time ended it already
                continue
            assert head + text == upto[:-len(stop)] and used == step[:j + 1 - split] and choice.stops.stopped
    choice = Choice(None, IncrementalDetokenizer(token_bytes), StopStringMatcher(()))
    assert EngineLoop._text_of(choice, ids) == (tokenizer.decode(ids), ids)


# --- flags --------------------------------------------------------------------------------------------


def test_flags_that_cannot_mean_anything_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
    """A draft model without --speculative draft, K without --speculative, K of 0, an unknown method, a draft
    model that is a file or is missing: exit 2 and one line, before anything loads (serve.py's main, in
    process). A directory holding no checkpoint as the draft model: the same from a real start of serve.py."""
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    started = subprocess.Popen([sys.executable, str(SERVE), "--port", "0", "--speculative", "draft", "--draft-model",
                                str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import serve
    cases = [["--draft-model", str(tmp_path)], ["--speculative", "ngram", "--draft-model", str(tmp_path)],
             ["--num-speculative-tokens", "2"], ["--speculative", "ngram", "--num-speculative-tokens", "0"],
             ["--speculative", "medusa"], ["--speculative", "draft", "--num-speculative-tokens", "two"],
             ["--speculative", "draft", "--draft-model", str(a_file)],
             ["--speculative", "draft", "--draft-model", str(tmp_path / "missing")]]
    for args in cases:
        monkeypatch.setattr(sys, "argv", ["serve.py", "--port", "0", *args])
        with pytest.raises(SystemExit) as exit_:
            serve.main()
        out, err = capsys.readouterr()
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), (args, err)
        assert out == "", args
    out, err = started.communicate(timeout=120)
    assert started.returncode == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert "serving" not in out

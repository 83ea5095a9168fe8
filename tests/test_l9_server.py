"""L9's server, live: scripts/serve.py started as a user starts it (ServerProcess), driven over HTTP with the
official `openai` client and raw `httpx`. Every greedy output is compared with HF's `generate` for that
prompt alone, computed in this run (the `hf` fixture); nothing here is a stored token list.

Three servers, started at once when the module begins (each takes seconds to load):
  main      --max-batched-tokens 32: a long prompt takes many steps to prefill, so a client can leave
            half-way through one; --max-body-bytes 64 KiB for the 413s
  small     --max-running 1 --max-waiting 2: the engine fills with one request, so others wait, and the
            third waiting one gets 429
  doomed    --shutdown-timeout 3: SIGTERM with streams open
Covered: completions and chat, streamed and whole, against HF (tokens, text, finish_reason, usage, prompt
ids); n > 1 with seeds; stop strings split across tokens; stop_token_ids; include_usage and the SSE framing;
emoji / CJK and characters split across output tokens; 32 concurrent streams; abort while decoding, while
prefilling and while waiting (the pool's gauges return to their level before); every refusal's status and
OpenAI error body beside a stream in flight; 429 with Retry-After; shutdown.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from lessons.l9_server.detokenizer import TokenBytes
from shared.server_process import ServerProcess
from shared.config import Qwen3Config
from shared.generation import StopRule

BODY_LIMIT = 64 * 1024
SERVERS = {
    "main": ["--max-batched-tokens", "32", "--max-body-bytes", str(BODY_LIMIT)],
    "small": ["--max-batched-tokens", "32", "--max-running", "1", "--max-waiting", "2"],
    "doomed": ["--shutdown-timeout", "3"],
}
TIMEOUT = 60.0  # every client call: a server bug fails the test, it never hangs it
FIRST_ADDED = 151643  # BPE ranks end here; the special tokens follow
UNICODE_PROMPT = "Emoji 🚀🔥🙂👩‍💻 and 東京の桜は三月に咲き始め"


# --- the servers ----------------------------------------------------------------------------------------


@dataclass
class Live:
    proc: ServerProcess
    fresh_metrics: dict[str, float]  # /metrics before any request reached the server

    @property
    def url(self) -> str:  # .../v1
        return self.proc.url

    @property
    def root(self) -> str:
        return self.proc.url.removesuffix("/v1")

    @property
    def model(self) -> str:
        return self.proc.model


def _launch(args: list[str]) -> Live:
    """Start one server, keep its /metrics as first seen, then send it one request: the engine thread
    publishes its gauges after a step, and every other test compares against a published level."""
    proc = ServerProcess(args).start()
    live = Live(proc, metrics_of(proc.url.removesuffix("/v1")))
    try:
        r = httpx.post(live.url + "/completions", json={"model": live.model, "prompt": "warm", "max_tokens": 1},
                       timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        wait_for(live, lambda m: m["paged_requests_running"] == 0
                 and m.get('paged_requests_finished_total{reason="length"}', 0) == 1, "warm-up")
    except BaseException:
        proc.kill()
        raise
    return live


@pytest.fixture(scope="module")
def launched():
    """All three servers start in parallel; each fixture below waits for its own. At the end every one is
    stopped with SIGTERM and must exit with status 0 (the shutdown test stops `doomed` itself)."""
    pool = ThreadPoolExecutor(len(SERVERS))
    futures = {name: pool.submit(_launch, args) for name, args in SERVERS.items()}
    yield futures
    statuses = {}
    for name, future in futures.items():
        try:
            live = future.result()
        except Exception as e:  # it never started: its own fixture has reported why
            statuses[name] = repr(e)
            continue
        statuses[name] = live.proc.stop(timeout=30)
    pool.shutdown()
    assert {n: s for n, s in statuses.items() if isinstance(s, int) and s != 0} == {}, \
        f"exit statuses after SIGTERM: {statuses}"


@pytest.fixture(scope="module")
def server(launched) -> Live:
    return launched["main"].result(timeout=240)


@pytest.fixture(scope="module")
def small(launched) -> Live:
    return launched["small"].result(timeout=240)


@pytest.fixture(scope="module")
def doomed(launched) -> Live:
    return launched["doomed"].result(timeout=240)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def eos(tiny_dir) -> frozenset[int]:
    return frozenset(Qwen3Config.from_dir(tiny_dir).eos_token_ids)


@pytest.fixture(scope="module")
def token_bytes(tokenizer) -> TokenBytes:
    return TokenBytes(tokenizer)


# --- helpers ---------------------------------------------------------------------------------------------


def metrics_of(root: str) -> dict[str, float]:
    """GET /metrics as {'name{labels}': value}."""
    text = httpx.get(root + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(paged_\S+) (\S+)$", text, re.M)}


def aborts(m: dict[str, float]) -> float:
    return m.get('paged_requests_finished_total{reason="abort"}', 0.0)


def wait_for(live: Live, cond, what: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until cond(metrics) holds; fail (never hang) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics_of(live.root)
        if cond(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:.0f} s; metrics now: "
                                 f"{ {k: v for k, v in m.items() if 'bucket' not in k} }; "
                                 f"server stderr: {live.proc.stderr_tail()}")
        time.sleep(0.02)


def wait_idle(live: Live, held: float, what: str) -> dict[str, float]:
    """The pool holds exactly `held` blocks again, and nothing runs or waits."""
    return wait_for(live, lambda m: m["paged_blocks_held"] == held and m["paged_requests_running"] == 0
                    and m["paged_requests_waiting"] == 0, what)


async def await_metrics(live: Live, cond, what: str, timeout: float = 20.0) -> dict[str, float]:
    return await asyncio.to_thread(wait_for, live, cond, what, timeout)


def random_ids(seed: int, n: int) -> list[int]:
    """A prompt as token ids: BPE tokens only (no specials), seeded."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ADDED) for _ in range(n)]


def greedy_ref(hf, eos, ids: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    return hf.generate(list(ids), StopRule(max_tokens, eos, ignore_eos)).tokens


@dataclass
class Choice:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finishes: list[str] = field(default_factory=list)
    pieces: list[tuple[str, list[int]]] = field(default_factory=list)  # (text, token ids) per chunk


@dataclass
class Result:
    choices: dict[int, Choice]
    usage: dict | None
    prompt_ids: list[int] | None = None
    usage_chunks: int = 0
    chunks: list = field(default_factory=list)

    @property
    def only(self) -> Choice:
        assert list(self.choices) == [0]
        return self.choices[0]


def usage_of(u) -> dict | None:
    return None if u is None else {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                                   "total_tokens": u.total_tokens}


def whole_result(r, chat: bool) -> Result:
    choices = {}
    for c in r.choices:
        text = c.message.content if chat else c.text
        choices[c.index] = Choice(list(c.model_extra["token_ids"]), text, [c.finish_reason])
    return Result(choices, usage_of(r.usage), r.model_extra.get("prompt_token_ids"))


def stream_result(chunks: list, chat: bool) -> Result:
    out = Result({}, None, chunks=chunks)
    for chunk in chunks:
        if chunk.usage is not None:
            out.usage = usage_of(chunk.usage)
            out.usage_chunks += 1
        for c in chunk.choices:
            choice = out.choices.setdefault(c.index, Choice())
            text = (c.delta.content or "") if chat else c.text
            ids = list(c.model_extra.get("token_ids") or [])
            choice.tokens += ids
            choice.text += text
            choice.pieces.append((text, ids))
            if c.finish_reason is not None:
                choice.finishes.append(c.finish_reason)
    return out


def complete(client, model: str, prompt, stream: bool = False, chat: bool = False, **kw) -> Result:
    """One request through the openai client, token ids returned; whole or streamed, the same Result."""
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    if chat:
        call = lambda **a: client.chat.completions.create(model=model, messages=prompt, extra_body=extra, **kw, **a)
    else:
        call = lambda **a: client.completions.create(model=model, prompt=prompt, extra_body=extra, **kw, **a)
    if not stream:
        return whole_result(call(), chat)
    if "stream_options" not in kw:  # streamed usage only when asked for; these checks want it
        kw["stream_options"] = {"include_usage": True}
    with call(stream=True) as s:
        return stream_result(list(s), chat)


async def acomplete(client, model: str, prompt, stream: bool = False, **kw) -> Result:
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    if not stream:
        return whole_result(await client.completions.create(model=model, prompt=prompt, extra_body=extra, **kw),
                            False)
    s = await client.completions.create(model=model, prompt=prompt, extra_body=extra, stream=True, **kw)
    return stream_result([c async for c in s], False)


def check_greedy(r: Result, expected: list[int], prompt_ids: list[int], tokenizer, eos, stream: bool,
                 ignore_eos: bool = False) -> None:
    """Tokens equal HF's; text is their decode; one finish, the right one; usage exact."""
    c = r.only
    assert c.tokens == expected
    assert c.text == tokenizer.decode(expected)
    ended = "stop" if (not ignore_eos and expected[-1] in eos) else "length"
    assert c.finishes == [ended]
    assert r.usage == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(expected),
                       "total_tokens": len(prompt_ids) + len(expected)}
    if not stream:
        assert r.prompt_ids == prompt_ids


def sse_payloads(raw: str) -> list[str]:
    """The data of each server-sent event; every event must be exactly `data: ...` and a blank line."""
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw.split("\n\n")[:-1]
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, repr(e)
    return [e[len("data: "):] for e in events]


def error_body(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    return err


# --- 0. the server itself ---------------------------------------------------------------------------------


def test_a_fresh_server_reports_its_pool(small):
    """Before any request, /metrics already describes the pool: some blocks free, the held ones exactly
    what an idle server holds once requests have come and gone (the dummy block), and the three block
    gauges sum to the same pool size as later on. A monitor reading a fresh server must not see 0 free."""
    live = small
    fresh = live.fresh_metrics  # taken before the fixture's warm-up request
    after = wait_for(live, lambda m: m["paged_requests_running"] == 0 and m["paged_requests_waiting"] == 0,
                     "the small server idle")
    total = sum(after[f"paged_blocks_{k}"] for k in ("free", "cached", "held"))
    assert total > 1
    assert fresh["paged_blocks_held"] == after["paged_blocks_held"]
    assert sum(fresh[f"paged_blocks_{k}"] for k in ("free", "cached", "held")) == total
    assert fresh["paged_blocks_free"] == total - after["paged_blocks_held"]


def test_health_and_models(server):
    """/health answers ok and /v1/models lists the served name with the model's context."""
    with httpx.Client(timeout=TIMEOUT) as http:
        assert http.get(server.root + "/health").json() == {"status": "ok"}
        models = http.get(server.url + "/models").json()
    assert [m["id"] for m in models["data"]] == [server.model] == ["tiny-qwen3-v3"]
    assert models["data"][0]["max_model_len"] == 4096


# --- 1. greedy parity: completions and chat, whole and streamed -----------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_equal_hf(server, client, hf, tokenizer, eos, stream):
    """A text prompt and a 120-token id prompt (4 prefill steps at budget 32): tokens equal HF's greedy
    output for the prompt alone, text is their decode, finish_reason "length", usage exact, prompt ids
    are the course tokenizer's."""
    text_prompt = "The capital of France is"
    ids_prompt = random_ids(11, 120)
    for prompt, max_tokens in ((text_prompt, 16), (ids_prompt, 12)):
        ids = tokenizer.encode(prompt).ids if isinstance(prompt, str) else prompt
        r = complete(client, server.model, prompt, stream=stream, max_tokens=max_tokens, temperature=0)
        check_greedy(r, greedy_ref(hf, eos, ids, max_tokens), ids, tokenizer, eos, stream)


@pytest.fixture(scope="module")
def chat_prompt_ids(tiny_dir, tokenizer):
    """The messages rendered by HF's own chat template, then encoded with the course's tokenizer."""
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three rivers in Europe."}]
    text = AutoTokenizer.from_pretrained(str(tiny_dir)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    return messages, tokenizer.encode(text).ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equals_hf_on_the_rendered_template(server, client, hf, tokenizer, eos, chat_prompt_ids, stream):
    """Chat: the prompt is HF's template rendering (prompt_token_ids and usage.prompt_tokens agree), the
    tokens equal HF's greedy output for it, the content is their decode. Streamed, the first chunk gives
    the role and empty content."""
    messages, ids = chat_prompt_ids
    expected = greedy_ref(hf, eos, ids, 12)
    r = complete(client, server.model, messages, stream=stream, chat=True, max_tokens=12, temperature=0,
                 stream_options={"include_usage": True} if stream else openai.NOT_GIVEN)
    check_greedy(r, expected, ids, tokenizer, eos, stream)
    if stream:
        first = r.chunks[0].choices[0]
        assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
        assert all(c.choices[0].delta.role is None for c in r.chunks[1:] if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_token_id_ends_with_stop(server, client, hf, tokenizer, eos, stream):
    """stop_token_ids = HF's k-th greedy token (the first k >= 2 not seen before it): exactly k + 1 tokens,
    the stop token kept as the last, finish_reason "stop", usage k + 1."""
    ids = tokenizer.encode("Hello, world!").ids
    full = greedy_ref(hf, eos, ids, 16)
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    r = complete(client, server.model, "Hello, world!", stream=stream, max_tokens=16, temperature=0,
                 extra_body={"stop_token_ids": [full[k]]})
    c = r.only
    assert c.tokens == full[: k + 1]
    assert c.text == tokenizer.decode(full[: k + 1])
    assert c.finishes == ["stop"]
    assert r.usage == {"prompt_tokens": len(ids), "completion_tokens": k + 1, "total_tokens": len(ids) + k + 1}


# --- 2. n > 1 with seeds ---------------------------------------------------------------------------------


def test_n3_children_equal_single_requests_with_seed_plus_i(server, client):
    """n = 3, temperature 0.9, seed s: choices indexed 0..2, choice i equal to a lone n = 1 request with
    seed s + i (L6's rule), the same on a repeat, and not all the same (the seeds differ)."""
    kw = dict(max_tokens=8, temperature=0.9, top_p=0.95)
    seed = 4242
    r = complete(client, server.model, "Hello, world!", n=3, seed=seed, **kw)
    assert sorted(r.choices) == [0, 1, 2]
    singles = [complete(client, server.model, "Hello, world!", n=1, seed=seed + i, **kw).only for i in range(3)]
    for i in range(3):
        assert r.choices[i].tokens == singles[i].tokens, f"choice {i}"
        assert r.choices[i].text == singles[i].text
        assert len(r.choices[i].tokens) == 8 and r.choices[i].finishes == ["length"]
    assert r.usage["completion_tokens"] == 24
    again = complete(client, server.model, "Hello, world!", n=3, seed=seed, **kw)
    assert [again.choices[i].tokens for i in range(3)] == [r.choices[i].tokens for i in range(3)]
    assert len({tuple(c.tokens) for c in r.choices.values()}) > 1, "three seeds gave one output: a weak test"


# --- 3. stop strings ------------------------------------------------------------------------------------


def split_stop(tokenizer, out: list[int]) -> tuple[str, int] | None:
    """A stop string made of the last 2 characters of token k and the first 2 of token k + 1, whose first
    occurrence in the decoded output is that one; and m, the tokens needed until it is complete."""
    full = tokenizer.decode(out)
    pieces = [tokenizer.decode([t]) for t in out]
    for k in range(len(out) - 1):
        a, b = pieces[k], pieces[k + 1]
        if len(a) < 2 or len(b) < 2 or "\ufffd" in a + b:
            continue
        head = tokenizer.decode(out[: k + 1])
        if not head.endswith(a) or tokenizer.decode(out[: k + 2]) != head + b:
            continue  # the pieces are not what the whole decode shows there
        stop = a[-2:] + b[:2]
        if stop.strip() != stop or full.find(stop) != len(head) - 2:
            continue
        return stop, k + 2
    return None


@pytest.fixture(scope="module")
def stop_case(hf, tokenizer, eos):
    """(prompt, HF's 24 greedy tokens, stop string split across two tokens, tokens until it completes)."""
    for prompt in ("The capital of France is", "Hello, world!", "a", "Paged attention stores blocks"):
        out = greedy_ref(hf, eos, tokenizer.encode(prompt).ids, 24)
        found = split_stop(tokenizer, out)
        if found:
            return prompt, out, *found
    pytest.fail("no candidate prompt's greedy output has two clean adjacent tokens for a split stop string")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_split_across_tokens(server, client, tokenizer, stop_case, stream):
    """The text ends right before the stop string's first occurrence (the greedy text cut there), the
    tokens are HF's up to the one that completed it (usage counts them), finish_reason "stop". Streamed,
    the chunks joined are exactly that text: no chunk ever showed a part of the stop string."""
    prompt, out, stop, m = stop_case
    full = tokenizer.decode(out)
    r = complete(client, server.model, prompt, stream=stream, max_tokens=24, temperature=0, stop=[stop])
    c = r.only
    assert c.text == full[: full.find(stop)]
    assert c.tokens == out[:m]
    assert c.finishes == ["stop"]
    assert r.usage["completion_tokens"] == m
    if stream:
        assert "".join(p for p, _ in c.pieces) == c.text  # nothing shown that the final text lacks


def test_a_held_stop_prefix_is_released_when_the_output_ends(server, client, tokenizer, stop_case):
    """A stop string that begins with the output's last 2 characters but never completes: those
    characters are held back at every step, then released at the end; text is the whole greedy text."""
    prompt, out, _, _ = stop_case
    full = tokenizer.decode(out)
    stop = full[-2:] + "\u2603\u2603"
    assert "\u2603" not in full
    r = complete(client, server.model, prompt, stream=True, max_tokens=24, temperature=0, stop=stop)
    assert r.only.text == full and r.only.tokens == out and r.only.finishes == ["length"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_ends_one_sibling_only(server, client, tokenizer, stream):
    """n = 2 sampled: a stop string split across two of choice 0's tokens (seeded, so the same request
    without it is the reference). Each choice ends where it first shows the stop string, or runs to
    max_tokens if it never does; the sibling that stopped takes nothing from the other; usage sums both."""
    kw = dict(n=2, temperature=1.0, max_tokens=16)
    for seed in range(99, 110):
        ref = complete(client, server.model, "Hello, world!", seed=seed, **kw)
        found = split_stop(tokenizer, ref.choices[0].tokens)
        if found:
            break
    else:
        pytest.fail("no seed gave choice 0 two clean adjacent tokens")
    stop = found[0]
    r = complete(client, server.model, "Hello, world!", seed=seed, stream=stream, stop=stop, **kw)
    total = 0
    for i in range(2):
        toks = ref.choices[i].tokens
        full = tokenizer.decode(toks)
        if stop in full:
            m = next(m for m in range(1, len(toks) + 1) if stop in tokenizer.decode(toks[:m]))
            expected = (full[: full.find(stop)], toks[:m], ["stop"])
        else:
            expected = (full, toks, ["length"])
        assert (r.choices[i].text, r.choices[i].tokens, r.choices[i].finishes) == expected, f"choice {i}"
        total += len(expected[1])
    assert r.choices[0].finishes == ["stop"]
    assert r.usage["completion_tokens"] == total


def test_a_request_filling_the_context_exactly_is_accepted(server):
    """prompt + max_tokens == 4096 (the context) is served (one past it is the 400 in the bad-input test);
    its client leaves after the first token and the pool returns to its level."""
    before = wait_idle(server, metrics_of(server.root)["paged_blocks_held"], "idle before")
    body = {"model": server.model, "prompt": random_ids(5, 100), "max_tokens": 3996, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", server.url + "/completions", json=body) as resp:
            assert resp.status_code == 200
            first = next(resp.iter_lines())
            assert first.startswith("data: {") and "text_completion" in first
    wait_idle(server, before["paged_blocks_held"], "the pool after leaving a context-filling request")


# --- 4. include_usage and the SSE framing ----------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_include_usage_chunks(server, client, tokenizer, chat):
    """n = 3 sampled, stream_options.include_usage: every chunk but the last has usage null, the last has
    no choices and the usage, each choice finishes exactly once (in its last chunk), and the streamed
    choices equal the same request whole."""
    prompt = [{"role": "user", "content": "Hi"}] if chat else "Hi"
    kw = dict(max_tokens=6, temperature=1.0, seed=7, n=3, chat=chat)
    r = complete(client, server.model, prompt, stream=True, stream_options={"include_usage": True}, **kw)
    *body, last = r.chunks
    assert all(ch.usage is None for ch in body)
    assert last.choices == [] and r.usage_chunks == 1
    assert sorted(r.choices) == [0, 1, 2]
    whole = complete(client, server.model, prompt, **kw)
    for i, c in r.choices.items():
        assert c.finishes == ["length"]
        if chat:  # each choice's first chunk gives the role, and only it
            roles = [x.delta.role for ch in r.chunks for x in ch.choices if x.index == i]
            assert roles[0] == "assistant" and set(roles[1:]) == {None}
        finals = [j for j, ch in enumerate(r.chunks) for x in ch.choices if x.index == i and x.finish_reason]
        assert finals == [max(j for j, ch in enumerate(r.chunks) for x in ch.choices if x.index == i)]
        assert c.tokens == whole.choices[i].tokens and c.text == whole.choices[i].text
        assert c.text == tokenizer.decode(c.tokens)
    assert r.usage == whole.usage == {"prompt_tokens": whole.usage["prompt_tokens"], "completion_tokens": 18,
                                      "total_tokens": whole.usage["prompt_tokens"] + 18}


@pytest.mark.parametrize("include_usage", [False, True])
def test_raw_sse_framing(server, tokenizer, include_usage):
    """On the wire: text/event-stream, every event is `data: <json>` and a blank line, the last one is
    `data: [DONE]`; with include_usage every JSON chunk has a "usage" key, null but in the last."""
    body = {"model": server.model, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
            "stream": True, "return_token_ids": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.Client(timeout=TIMEOUT) as http:
        r = http.post(server.url + "/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(r.text)
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    chunks = [json.loads(p) for p in payloads[:-1]]
    tokens = [t for ch in chunks for c in ch["choices"] for t in c["token_ids"]]
    assert len(tokens) == 5
    assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == tokenizer.decode(tokens)
    if include_usage:
        assert all("usage" in ch for ch in chunks)
        assert [ch["usage"] is None for ch in chunks] == [True] * (len(chunks) - 1) + [False]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    else:
        assert all(ch.get("usage") is None for ch in chunks)


# --- 5. emoji, CJK, and characters split across output tokens --------------------------------------------


def test_emoji_and_cjk_prompt_streams_valid_text(server, client, hf, tokenizer, eos):
    """A prompt of emoji (one a ZWJ sequence) and CJK: the server's prompt ids are the course tokenizer's,
    the tokens equal HF's, the joined stream equals the decode of all tokens, and a U+FFFD appears in a
    chunk only where the whole decode has one at that place."""
    ids = tokenizer.encode(UNICODE_PROMPT).ids
    expected = greedy_ref(hf, eos, ids, 24)
    r = complete(client, server.model, UNICODE_PROMPT, stream=True, max_tokens=24, temperature=0,
                 stream_options={"include_usage": True})
    check_greedy(r, expected, ids, tokenizer, eos, stream=True)
    full = tokenizer.decode(expected)
    at = 0
    for text, _ in r.only.pieces:
        for j, ch in enumerate(text):
            if ch == "\ufffd":
                assert full[at + j] == "\ufffd", f"a replacement character at {at + j} that the decode lacks"
        at += len(text)
    assert at == len(full)


def incomplete_tail(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"
    return False


def test_a_character_split_in_the_output_is_never_shown_half(server, tokenizer, token_bytes):
    """Greedy outputs of a few prompts, streamed, one token per chunk: find a token whose bytes end in an
    unfinished UTF-8 character, after clean text. Its chunk holds that character back (no U+FFFD), the
    text so far is exactly the decode up to it without the pending character, and the joined stream is
    the tokenizer's decode of all tokens (where a character is never finished, U+FFFD appears only once
    the next token shows it can't be)."""
    candidates = ["中文测试句子", "日本語のテキスト", "The capital of France is", "Привет мир", "🙂"]

    async def run() -> list[Result]:
        async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(acomplete(c, server.model, p, stream=True, max_tokens=32, temperature=0)
                                          for p in candidates))

    found = 0
    for prompt, r in zip(candidates, asyncio.run(run())):
        c = r.only
        full = tokenizer.decode(c.tokens)
        assert c.text == full, prompt
        assert all(len(ids) == 1 for _, ids in c.pieces), "one token per chunk expected with return_token_ids"
        so_far = ""
        for k, (text, ids) in enumerate(c.pieces):
            before = b"".join(token_bytes(t) for t in c.tokens[:k])
            so_far += text
            clean_before = not incomplete_tail(before) and "\ufffd" not in before.decode("utf-8", "replace")
            if clean_before and incomplete_tail(token_bytes(ids[0])) and k + 1 < len(c.pieces):
                found += 1
                assert "\ufffd" not in text, (prompt, k)
                assert so_far == tokenizer.decode(c.tokens[: k + 1]).rstrip("\ufffd"), (prompt, k)
                assert full.startswith(so_far)
    assert found, "no candidate's output split a character: add prompts"


# --- 6. 32 concurrent streams -----------------------------------------------------------------------------


def test_32_concurrent_streams_equal_hf(server, hf, tokenizer, eos):
    """32 streaming clients at once (AsyncOpenAI, asyncio.gather), prompts of 1 to 200 tokens (some sharing
    prefixes), 4 to 10 new tokens each: every stream equals HF's output for its prompt alone, complete
    (one finish, exact usage, text = decode), and the pool is back to its level afterwards."""
    rng = random.Random(32)
    corpus = random_ids(320, 600)
    prompts, news = [], []
    for i in range(32):
        n = rng.choice([1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 64, 65, 100, 150, 200])
        start = 0 if i % 5 == 0 else rng.randrange(len(corpus) - n)  # every fifth shares the corpus's start
        prompts.append(corpus[start:start + n])
        news.append(rng.randint(4, 10))
    before = metrics_of(server.root)

    async def run() -> list[Result]:
        async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(
                acomplete(c, server.model, p, stream=True, max_tokens=n, temperature=0,
                          stream_options={"include_usage": True}) for p, n in zip(prompts, news)))

    results = asyncio.run(run())
    for i, (p, n, r) in enumerate(zip(prompts, news, results)):
        check_greedy(r, greedy_ref(hf, eos, p, n), p, tokenizer, eos, stream=True)
    wait_idle(server, before["paged_blocks_held"], "the pool after 32 streams")


# --- 7. abort ----------------------------------------------------------------------------------------------


def test_abort_mid_stream_frees_the_pool(server, client, hf, tokenizer, eos):
    """A client that leaves after 5 chunks of a 2,000-token ignore_eos stream: its request is aborted
    (the abort counter rises), the held blocks return to their level before, nothing runs or waits, and
    the same prompt is then served correctly from what the pool kept."""
    prompt = random_ids(71, 40)
    before = wait_idle(server, metrics_of(server.root)["paged_blocks_held"], "idle before")
    got = []
    with client.completions.create(model=server.model, prompt=prompt, max_tokens=2000, temperature=0, stream=True,
                                   extra_body={"return_token_ids": True, "ignore_eos": True}) as s:
        for chunk in s:
            got += chunk.choices[0].model_extra["token_ids"]
            if len(got) >= 5:
                break
        during = metrics_of(server.root)
        assert during["paged_blocks_held"] > before["paged_blocks_held"]
    after = wait_idle(server, before["paged_blocks_held"], "the pool after a mid-stream disconnect")
    assert aborts(after) == aborts(before) + 1
    expected = greedy_ref(hf, eos, prompt, 8, ignore_eos=True)
    assert got == expected[: len(got)]
    r = complete(client, server.model, prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    check_greedy(r, expected, prompt, tokenizer, eos, stream=False, ignore_eos=True)


def test_abort_mid_prefill_frees_the_pool(server, client, hf, tokenizer, eos):
    """A 2,000-token prompt given as ids (63 steps of 32 to prefill): the client leaves once the prefill has
    begun (blocks held) and before any token exists (the TTFT count has not moved, then or ever). The
    abort frees what it held; the same prompt is then served correctly (blocks the aborted prefill wrote
    and registered stay in the prefix cache, so a wrong registration would show here)."""
    prompt = random_ids(72, 2000)
    before = wait_idle(server, metrics_of(server.root)["paged_blocks_held"], "idle before")
    ttft = "paged_time_to_first_token_seconds_count"
    body = {"model": server.model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", server.url + "/completions", json=body) as resp:
            assert resp.status_code == 200
            mid = wait_for(server, lambda m: m["paged_blocks_held"] > before["paged_blocks_held"] + 4,
                           "the prefill started", timeout=20)
            assert mid[ttft] == before[ttft], "the prefill finished before the client could leave"
    after = wait_idle(server, before["paged_blocks_held"], "the pool after a mid-prefill disconnect")
    assert after[ttft] == before[ttft], "a token was produced after the client left"
    assert aborts(after) == aborts(before) + 1
    r = complete(client, server.model, prompt, max_tokens=4, temperature=0)
    check_greedy(r, greedy_ref(hf, eos, prompt, 4), prompt, tokenizer, eos, stream=False)


def test_abort_while_waiting_frees_its_place(small, hf, tokenizer, eos):
    """On the max-running-1 server: a 2,000-token stream fills the engine, a whole (non-streamed) request
    waits behind it; cancelling the client's task takes it out of the waiting queue at once (the filler
    still running), then the filler's client leaves too; the pool returns to its level and a following
    request is served correctly."""
    filler = {"model": small.model, "prompt": random_ids(73, 20), "max_tokens": 2000, "temperature": 0,
              "stream": True, "ignore_eos": True}
    before = wait_idle(small, metrics_of(small.root)["paged_blocks_held"], "idle before")

    async def run() -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            async with http.stream("POST", small.url + "/completions", json=filler) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()  # kept: a dropped iterator would close the stream
                await lines.__anext__()  # it runs
                async with openai.AsyncOpenAI(base_url=small.url, api_key="unused", max_retries=0,
                                              timeout=TIMEOUT) as victim_client:
                    victim = asyncio.create_task(victim_client.completions.create(
                        model=small.model, prompt="waiting in line", max_tokens=4, temperature=0))
                    await await_metrics(small, lambda m: m["paged_requests_waiting"] == 1, "the victim waits")
                    victim.cancel()  # closes its connection: the server sees the client leave
                    with pytest.raises(asyncio.CancelledError):
                        await victim
                m = await await_metrics(small, lambda m: m["paged_requests_waiting"] == 0,
                                        "the cancelled request leaves the queue")
                assert m["paged_requests_running"] == 1, "the filler must still be running"
                assert aborts(m) == aborts(before) + 1

    asyncio.run(asyncio.wait_for(run(), 60))
    after = wait_idle(small, before["paged_blocks_held"], "the pool after both clients left")
    assert aborts(after) == aborts(before) + 2
    ids = tokenizer.encode("waiting in line").ids
    with openai.OpenAI(base_url=small.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        r = complete(c, small.model, "waiting in line", max_tokens=6, temperature=0)
    check_greedy(r, greedy_ref(hf, eos, ids, 6), ids, tokenizer, eos, stream=False)


# --- 8. bad input ------------------------------------------------------------------------------------------


def bad_cases(model: str) -> list[tuple[str, str, object, int, str | None, str | None]]:
    """(name, path, JSON body or raw bytes/iterator, status, param, code)."""
    ok = {"model": model, "prompt": "hi", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    big = json.dumps(ok | {"prompt": "x" * (BODY_LIMIT + 10)}).encode()
    return [
        ("temperature too high", "/completions", ok | {"temperature": 2.5}, 400, "temperature", None),
        ("negative temperature", "/completions", ok | {"temperature": -0.1}, 400, "temperature", None),
        ("top_p 0", "/completions", ok | {"top_p": 0}, 400, "top_p", None),
        ("n 0", "/completions", ok | {"n": 0, "temperature": 1}, 400, "n", None),
        ("greedy n 2", "/completions", ok | {"n": 2, "temperature": 0}, 400, "n", None),
        ("negative max_tokens", "/completions", ok | {"max_tokens": -1}, 400, "max_tokens", None),
        ("unknown model", "/completions", ok | {"model": "gpt-5"}, 404, "model", "model_not_found"),
        ("past the context", "/completions", ok | {"prompt": random_ids(5, 100), "max_tokens": 3997}, 400,
         "max_tokens", None),
        ("token id past the vocabulary", "/completions", ok | {"prompt": [1, 2, 151936]}, 400, "prompt", None),
        ("negative token id", "/completions", ok | {"prompt": [1, -5]}, 400, "prompt", None),
        ("malformed JSON", "/completions", b'{"model": "tiny", "prompt": ', 400, None, None),
        ("not an object", "/completions", b"[1, 2]", 400, None, None),
        ("body over the limit", "/completions", big, 413, None, None),
        ("chunked body over the limit", "/completions",
         (big[i:i + 8192] for i in range(0, len(big), 8192)), 413, None, None),
        ("logprobs 5", "/completions", ok | {"logprobs": 5}, 400, "logprobs", None),
        ("chat logprobs true", "/chat/completions", chat | {"logprobs": True}, 400, "logprobs", None),
        ("tools", "/chat/completions", chat | {"tools": [{"type": "function", "function": {"name": "f"}}]},
         400, "tools", None),
        ("presence_penalty", "/completions", ok | {"presence_penalty": 0.5}, 400, "presence_penalty", None),
        ("unknown field", "/completions", ok | {"temprature": 0}, 400, "temprature", None),
        ("stream_options without stream", "/completions", ok | {"stream_options": {"include_usage": True}}, 400,
         "stream_options", None),
        ("five stop strings", "/completions", ok | {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
        ("image part", "/chat/completions",
         chat | {"messages": [{"role": "user", "content": [
             {"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
         400, "messages[0].content[1]", None),
        ("unknown path", "/embeddings", ok, 404, None, None),
    ]


def test_bad_input_is_refused_by_name_beside_a_stream(server, hf, tokenizer, eos):
    """Each bad request gets its status and OpenAI's error object naming the field, while a long greedy
    stream is in flight beside them; that stream then finishes with exactly HF's tokens."""
    # 400 tokens: long enough to outlast the ~20 bad requests on a loaded 2-core box (100 did not, once).
    prompt, new = random_ids(81, 300), 400
    state: dict = {"tokens": [], "finishes": [], "error": None}
    first = threading.Event()

    def reader() -> None:
        try:
            with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
                with c.completions.create(model=server.model, prompt=prompt, max_tokens=new, temperature=0,
                                          stream=True, extra_body={"return_token_ids": True, "ignore_eos": True}) as s:
                    for chunk in s:
                        for ch in chunk.choices:
                            state["tokens"] += ch.model_extra["token_ids"]
                            if ch.finish_reason:
                                state["finishes"].append(ch.finish_reason)
                        first.set()
        except Exception as e:  # reported by the main thread
            state["error"] = e
            first.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    assert first.wait(TIMEOUT) and state["error"] is None, state["error"]
    wrong = []
    with httpx.Client(timeout=TIMEOUT) as http:
        for name, path, body, status, param, code in bad_cases(server.model):
            kwargs = {"json": body} if isinstance(body, dict) else {"content": body}
            resp = http.post(server.url + path, **kwargs)
            is_json = resp.headers.get("content-type", "").startswith("application/json")
            err = error_body(resp) if is_json else {"param": "<not json>", "code": None, "type": None}
            got = (resp.status_code, err["param"], err["code"], err["type"])
            if got != (status, param, code, "invalid_request_error"):
                wrong.append(f"{name}: expected {(status, param, code)}, got {got}: {resp.text[:200]}")
    in_flight = not state["finishes"]
    expected = greedy_ref(hf, eos, prompt, new, ignore_eos=True)
    thread.join(TIMEOUT)
    assert not thread.is_alive() and state["error"] is None, state["error"]
    assert wrong == []
    assert in_flight, "the stream finished before the bad requests were all sent: make it longer"
    assert state["tokens"] == expected and state["finishes"] == ["length"]


def test_do_nothing_values_of_unsupported_fields_are_accepted(server):
    """A field the server does not implement, given its do-nothing value, is accepted (as the protocol's
    docstring and the lesson promise), whatever JSON number type it comes as: a client library that
    sends presence_penalty 0.0 asks for nothing."""
    ok = {"model": server.model, "prompt": "hi", "max_tokens": 1, "temperature": 0}
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "temperature": 0}
    cases = [("/completions", ok | extra) for extra in (
        {"logprobs": None}, {"echo": False}, {"best_of": 1}, {"presence_penalty": 0},
        {"presence_penalty": 0.0}, {"frequency_penalty": 0.0}, {"logit_bias": {}}, {"suffix": None})]
    cases += [("/chat/completions", chat | extra) for extra in (
        {"logprobs": False}, {"top_logprobs": 0}, {"tools": []}, {"tool_choice": "none"},
        {"response_format": {"type": "text"}}, {"presence_penalty": 0.0}, {"frequency_penalty": 0})]
    refused = []
    with httpx.Client(timeout=TIMEOUT) as http:
        for path, body in cases:
            resp = http.post(server.url + path, json=body)
            if resp.status_code != 200:
                refused.append(f"{path} {json.dumps({k: v for k, v in body.items() if k not in ok})}: "
                               f"{resp.status_code} {resp.text[:120]}")
    assert refused == []


def test_429_with_retry_after_when_the_queue_is_full(small, hf, tokenizer, eos):
    """max-running 1, max-waiting 2: one stream runs, two whole requests wait; a third gets 429 with
    Retry-After and a rate_limit_error body. Once the stream's client leaves, the two waiting requests are
    served with HF's tokens, and the pool returns to its level."""
    filler = {"model": small.model, "prompt": random_ids(91, 20), "max_tokens": 2000, "temperature": 0,
              "stream": True, "ignore_eos": True}
    before = wait_idle(small, metrics_of(small.root)["paged_blocks_held"], "idle before")
    waiting_prompts = [random_ids(92, 10), random_ids(93, 30)]

    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            async def whole(ids):
                return await http.post(small.url + "/completions", json={
                    "model": small.model, "prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True})

            async with http.stream("POST", small.url + "/completions", json=filler) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()  # kept: a dropped iterator would close the stream
                await lines.__anext__()
                waiting = [asyncio.create_task(whole(p)) for p in waiting_prompts]
                await await_metrics(small, lambda m: m["paged_requests_waiting"] == 2, "two requests wait")
                third = await http.post(small.url + "/completions", json={
                    "model": small.model, "prompt": "one too many", "max_tokens": 2, "temperature": 0})
                m = metrics_of(small.root)
                assert m["paged_requests_running"] == 1 and m["paged_requests_waiting"] == 2
            return third, await asyncio.gather(*waiting)

    third, served = asyncio.run(asyncio.wait_for(run(), 60))
    assert third.status_code == 429, third.text
    assert third.headers.get("retry-after") == "1"
    err = error_body(third)
    assert err["type"] == "rate_limit_error" and err["param"] is None
    for ids, resp in zip(waiting_prompts, served):
        assert resp.status_code == 200, resp.text
        c = resp.json()["choices"][0]
        assert c["token_ids"] == greedy_ref(hf, eos, ids, 5) and c["finish_reason"] == "length"
        assert c["text"] == tokenizer.decode(c["token_ids"])
    after = wait_idle(small, before["paged_blocks_held"], "the pool after the 429 test")
    rejected = 'paged_requests_rejected_total{status="429"}'
    assert after[rejected] == before.get(rejected, 0.0) + 1


# --- 9. shutdown -----------------------------------------------------------------------------------------


def test_sigterm_finishes_short_streams_cuts_long_ones_and_exits_0(doomed, hf, tokenizer, eos):
    """SIGTERM with two streams open (--shutdown-timeout 3): the short one (12 tokens: it finishes inside
    the grace period even on a loaded box) completes with [DONE] and HF's tokens; the 2,000-token one is
    answered in-band when the grace period ends (a 503 error event, then [DONE]); a request sent after the
    signal is refused (connection refused, or 503); the process exits 0 within 20 s."""
    short_prompt = random_ids(95, 12)
    long_body = {"model": doomed.model, "prompt": random_ids(96, 12), "max_tokens": 2000, "temperature": 0,
                 "stream": True, "ignore_eos": True}
    short_body = {"model": doomed.model, "prompt": short_prompt, "max_tokens": 12, "temperature": 0,
                  "stream": True, "ignore_eos": True, "return_token_ids": True}

    async def read(resp: httpx.Response, sink: list[str]) -> str:
        try:
            async for line in resp.aiter_lines():
                if line:
                    sink.append(line)
            return "ended"
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            return f"closed: {type(e).__name__}"

    async def run():
        timeout = httpx.Timeout(TIMEOUT, read=15.0)
        async with httpx.AsyncClient(timeout=timeout) as a, httpx.AsyncClient(timeout=timeout) as b:
            long_lines, short_lines = [], []
            async with a.stream("POST", doomed.url + "/completions", json=long_body) as long_resp:
                assert long_resp.status_code == 200
                async with b.stream("POST", doomed.url + "/completions", json=short_body) as short_resp:
                    assert short_resp.status_code == 200
                    t0 = time.monotonic()
                    stopping = asyncio.create_task(asyncio.to_thread(doomed.proc.stop, 20))
                    await asyncio.sleep(0.3)  # the signal has been handled
                    try:
                        async with httpx.AsyncClient(timeout=10) as c:
                            late = await c.post(doomed.url + "/completions", json={
                                "model": doomed.model, "prompt": "too late", "max_tokens": 2})
                        late_outcome = late.status_code
                    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
                        late_outcome = type(e).__name__
                    short_end = await read(short_resp, short_lines)
                long_end = await read(long_resp, long_lines)
            status = await stopping
            return status, time.monotonic() - t0, late_outcome, short_end, short_lines, long_end, long_lines

    status, elapsed, late, short_end, short_lines, long_end, long_lines = asyncio.run(asyncio.wait_for(run(), 60))
    assert status == 0, f"exit status {status}; stderr: {doomed.proc.stderr_tail()}"
    assert elapsed < 20
    assert late in (503, "ConnectError", "RemoteProtocolError", "ReadError"), late
    assert short_end == "ended" and short_lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in short_lines[:-1]]
    tokens = [t for ch in chunks for c in ch["choices"] for t in c["token_ids"]]
    assert tokens == greedy_ref(hf, eos, short_prompt, 12, ignore_eos=True)
    assert long_end == "ended" and long_lines[-1] == "data: [DONE]", (long_end, long_lines[-2:])
    error = json.loads(long_lines[-2][len("data: "):])["error"]
    assert "shutting down" in error["message"] and error["type"] == "server_error", error
    assert len(long_lines) < 2000, "the long stream ran to its end: the grace period was not applied"

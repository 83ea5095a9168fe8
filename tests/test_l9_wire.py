"""L9's request path against malformed and hostile bodies, and the fields real clients send (issue 27).

In-process first (FastAPI's TestClient over the app, the tiny model's real tokenizer behind a spy, and a stub
engine loop whose submit records the prompt ids and answers 503), then one live server (ServerProcess):
- a prompt that cannot fit is refused before the tokenizer sees it, by a bound that is exact: a prompt of
  exactly the bound's bytes (the longest token, repeated) fits the context exactly and is admitted;
- the cheap refusals (model, full queue, max_tokens past the context) come before the template and the tokenizer;
- the tokenizer runs without holding the GIL (a ticker thread advances while it works);
- JSON nested 5,000 deep, and lone UTF-16 surrogates in values and in field names, are 400s naming the field;
- every field of OpenAI's API (read from the installed official client) and the vLLM extensions clients send
  is implemented, ignored or refused by name, never "unknown"; a message's name is refused by name;
- live: a battery of hostile bodies and a client leaving mid-body are all 4xx in OpenAI's error shape and leave
  no traceback in the server's log; the official client's fields, and vLLM's continuous_usage_stats.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types import completion_create_params
from openai.types.chat import ChatCompletionStreamOptionsParam
from openai.types.chat import completion_create_params as chat_create_params

from lessons.l9_server.app import ServedModel, create_app, longest_token_bytes
from lessons.l9_server.metrics import ServerMetrics
from shared.server_process import ServerProcess
from lessons.l9_server.protocol import (IGNORED, IGNORED_STREAM_OPTIONS, NEUTRAL, STREAM_OPTIONS, ApiError,
                                        parse_chat, parse_completion)
from shared.config import Qwen3Config

TIMEOUT = 60.0
MODEL = "tiny"
QWEN3_LONGEST_TOKEN = 128  # bytes: 128 spaces, token 56940


# --- the in-process app ----------------------------------------------------------------------------------


class SpyTokenizer:
    """The real tokenizer, recording each encode call and how far the ticker got while it ran."""

    def __init__(self, tokenizer, ticker: "Ticker | None" = None):
        self.tokenizer, self.ticker = tokenizer, ticker
        self.calls: list[str] = []
        self.ticks_during: list[int] = []

    def _spy(self, name: str, *args):
        self.calls.append(name)
        before = self.ticker.count if self.ticker else 0
        out = getattr(self.tokenizer, name)(*args)
        self.ticks_during.append((self.ticker.count if self.ticker else 0) - before)
        return out

    def encode(self, *args):
        return self._spy("encode", *args)

    def encode_batch(self, *args):
        return self._spy("encode_batch", *args)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


class StubChat:
    """A chat template that renders each message's content, counting renders."""

    def __init__(self):
        self.renders = 0

    def render(self, messages: list[dict], kwargs: dict) -> str:
        self.renders += 1
        return "".join(m["content"] for m in messages)


class StubLoop:
    """What the app needs of the engine loop; submit records the prompt ids and answers 503."""

    def __init__(self, num_waiting: int = 0, max_waiting: int = 8):
        self.metrics, self.num_waiting, self.max_waiting = ServerMetrics(), num_waiting, max_waiting
        self.submitted: list[list[int]] = []
        self.failure, self.accepting = None, True

    def submit(self, ids, req, subscriber) -> int:
        self.submitted.append(ids)
        raise ApiError(503, "stub engine: the request was admitted", kind="server_error")


@pytest.fixture(scope="module")
def context(tiny_dir) -> int:
    return Qwen3Config.from_dir(tiny_dir).max_position_embeddings


def make_app(tokenizer, context: int, loop: StubLoop | None = None, ticker=None):
    spy, chat, loop = SpyTokenizer(tokenizer, ticker), StubChat(), loop or StubLoop()
    app = create_app(ServedModel(MODEL, spy, chat, context, tokenizer.get_vocab_size()), loop,
                     max_body_bytes=4 << 20)
    return TestClient(app, raise_server_exceptions=False), SimpleNamespace(tokenizer=spy, chat=chat, loop=loop)


def completion(prompt, **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, **fields}


def chat(content: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def error_of(resp: httpx.Response) -> dict:
    """OpenAI's error object, checked for shape; the body must be JSON that any client can decode."""
    assert resp.headers["content-type"].startswith("application/json"), resp.text[:200]
    err = json.loads(resp.content.decode("utf-8"))["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_the_longest_token_is_128_bytes(tokenizer):
    """The bound's constant, computed from the vocabulary: Qwen3's longest piece is a run of 128 spaces."""
    assert longest_token_bytes(tokenizer) == QWEN3_LONGEST_TOKEN
    assert tokenizer.encode(" " * QWEN3_LONGEST_TOKEN).ids == [56940]


def test_a_prompt_past_the_bound_is_refused_before_the_tokenizer(tokenizer, context):
    """max_tokens 16 leaves room for 4,080 tokens of at most 128 bytes: a prompt of one byte more is a 400
    naming the prompt (chat: the messages) and the tokenizer is never called. At exactly the bound, 128-space
    runs encode to exactly 4,080 tokens: the prompt fills the context and is admitted (the bound cannot be
    tighter). Before: every prompt was tokenized first (0.5 s for half a megabyte), then refused."""
    client, app = make_app(tokenizer, context)
    room = context - 16
    limit = room * QWEN3_LONGEST_TOKEN
    resp = client.post("/v1/completions", json=completion("a" * (limit + 1), max_tokens=16))
    assert resp.status_code == 400 and error_of(resp)["param"] == "prompt", resp.text
    resp = client.post("/v1/chat/completions", json=chat("é" * (limit // 2 + 1), max_tokens=16))
    assert resp.status_code == 400 and error_of(resp)["param"] == "messages", resp.text
    assert app.tokenizer.calls == [] and app.loop.submitted == []
    resp = client.post("/v1/completions", json=completion(" " * limit, max_tokens=16))
    assert resp.status_code == 503, resp.text  # the stub engine's answer: it passed every check
    assert app.tokenizer.calls == ["encode_batch"] and len(app.loop.submitted[0]) == room


def test_the_bound_counts_bytes_after_normalization(tokenizer, context):
    """The tokenizer composes e + U+0301 into é (NFC): 3 bytes become 2. A prompt over the bound in raw bytes
    but not once normalized reaches the tokenizer (then the context check refuses it, naming max_tokens)."""
    client, app = make_app(tokenizer, context)
    limit = (context - 16) * QWEN3_LONGEST_TOKEN
    prompt = "e\u0301" * (limit // 2)
    assert len(prompt.encode()) > limit
    resp = client.post("/v1/completions", json=completion(prompt, max_tokens=16))
    assert resp.status_code == 400 and error_of(resp)["param"] == "max_tokens", resp.text
    assert app.tokenizer.calls == ["encode_batch"]


def test_the_cheap_refusals_come_before_the_template_and_the_tokenizer(tokenizer, context):
    """A wrong model (404), a full waiting queue (429 with Retry-After) and max_tokens that leaves no room for
    a prompt (400) are answered without rendering the chat template or tokenizing. Before: chat rendered the
    template before checking the model, and a full queue was found only after tokenizing."""
    client, app = make_app(tokenizer, context)
    resp = client.post("/v1/chat/completions", json=chat("hi") | {"model": "gpt-5"})
    assert resp.status_code == 404 and error_of(resp)["code"] == "model_not_found"
    resp = client.post("/v1/completions", json=completion("hi", max_tokens=context))
    assert resp.status_code == 400 and error_of(resp)["param"] == "max_tokens", resp.text
    assert (app.chat.renders, app.tokenizer.calls) == (0, [])
    client, app = make_app(tokenizer, context, StubLoop(num_waiting=8, max_waiting=8))
    for path, body in (("/v1/completions", completion("hi")), ("/v1/chat/completions", chat("hi"))):
        resp = client.post(path, json=body)
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert error_of(resp)["type"] == "rate_limit_error"
    assert (app.chat.renders, app.tokenizer.calls, app.loop.submitted) == (0, [], [])


class Ticker:
    """A thread that counts 1 ms sleeps: it advances only while no other thread holds the GIL."""

    def __init__(self):
        self.count, self.running = 0, True
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.running:
            time.sleep(0.001)
            self.count += 1

    def __enter__(self) -> "Ticker":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()


def test_the_tokenizer_lets_go_of_the_gil(tokenizer, context):
    """The longest admissible prompt (max_tokens 1: 4,095 x 128 bytes of words, about 0.5 s to encode on this
    box) is tokenized while a ticker thread goes on counting: the app calls encode_batch, which lets go of the
    GIL. Before: encode held it for the whole call and the ticker stood still (0 or 1 tick)."""
    words = "paged attention keeps the cache in blocks 東京 🙂 "
    limit = (context - 1) * QWEN3_LONGEST_TOKEN
    prompt = (words * (limit // len(words.encode()) + 1)).encode()[:limit].decode(errors="ignore")
    with Ticker() as ticker:
        client, app = make_app(tokenizer, context, ticker=ticker)
        resp = client.post("/v1/completions", json=completion(prompt, max_tokens=1))
    assert resp.status_code == 400 and error_of(resp)["param"] == "max_tokens", resp.text  # tokenized, too long
    assert app.tokenizer.calls == ["encode_batch"]
    assert app.tokenizer.ticks_during[0] >= 10, f"the ticker advanced {app.tokenizer.ticks_during[0]} times"


# --- malformed bodies ------------------------------------------------------------------------------------


def test_json_nested_5000_deep_is_a_400(tokenizer, context):
    """A 10 KB body nesting 5,000 lists inside an unknown field: json.loads raises RecursionError, which was
    not caught (a 500 with a traceback). Now OpenAI's 400."""
    client, _ = make_app(tokenizer, context)
    body = b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "deeply" in error_of(resp)["message"], resp.text


SURROGATES = [  # (raw JSON body, the param named)
    (b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    (b'{"model": "tiny", "prompt": "hi", "stop": ["x", "\\uDC00"]}', "stop[1]"),
    (b'{"model": "tiny", "prompt": "hi", "metadata": {"k": "\\ud800"}}', "metadata.k"),
    (b'{"model": "tiny", "prompt": "hi", "\\ud800": 1}', "\\ud800"),
    (b'{"model": "tiny", "prompt": "hi", "metadata": {"\\udfff": 1}}', "metadata.\\udfff"),
]


@pytest.mark.parametrize("body, param", SURROGATES, ids=[p for _, p in SURROGATES])
def test_a_lone_surrogate_is_a_400_naming_its_field(tokenizer, context, body, param):
    """JSON may spell a lone UTF-16 surrogate ("\\ud800"), which no UTF-8 text holds. In a prompt the tokenizer
    raised (a 500, plain text); in a field name the refusal's own reply failed to encode (a 500). Now a 400
    whose param names the field, with the surrogate written as its escape."""
    client, app = make_app(tokenizer, context)
    resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and error_of(resp)["param"] == param, resp.text
    assert app.tokenizer.calls == []


def test_a_surrogate_in_a_chat_message_and_a_surrogate_pair(tokenizer, context):
    """Chat content with a lone surrogate is refused naming messages[0].content; a surrogate pair is an
    ordinary character (🙂) and is tokenized as one."""
    client, app = make_app(tokenizer, context)
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}'
    resp = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and error_of(resp)["param"] == "messages[0].content", resp.text
    body = b'{"model": "tiny", "prompt": "\\ud83d\\ude42"}'
    resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 503 and app.loop.submitted == [tokenizer.encode("🙂").ids]


# --- the fields real clients send ------------------------------------------------------------------------


def api_fields(params) -> set[str]:
    return set(params.CompletionCreateParamsBase.__annotations__) | {"stream"}


def test_no_field_of_openais_api_is_unknown():
    """Every field the installed official client can send (completions and chat), given null, is either
    accepted or refused naming itself, never as "unknown". Before: store, metadata, service_tier,
    reasoning_effort and a dozen more were "unknown field"."""
    cases = [(parse_completion, {"model": "m", "prompt": "hi"}, api_fields(completion_create_params)),
             (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
              api_fields(chat_create_params))]
    unknown = []
    for parse, base, fields in cases:
        for name in sorted(fields - set(base)):
            try:
                parse({**base, name: None}, 16)
            except ApiError as e:
                if "unknown" in e.message or e.param != name:
                    unknown.append(f"{parse.__name__} {name}: {e.message}")
    assert unknown == []
    assert set(ChatCompletionStreamOptionsParam.__annotations__) <= STREAM_OPTIONS | IGNORED_STREAM_OPTIONS


ACCEPTED = [{"store": False}, {"store": None}, {"metadata": {}}, {"metadata": None},
            {"service_tier": "auto"}, {"service_tier": "default"}, {"user": "u"}, {"safety_identifier": "s"},
            {"prompt_cache_key": "k"}, {"reasoning_effort": None}, {"verbosity": None}, {"modalities": ["text"]},
            {"repetition_penalty": 1.0}, {"min_tokens": 0}, {"min_p": 0.0}, {"skip_special_tokens": True},
            {"spaces_between_special_tokens": False}, {"include_stop_str_in_output": False},
            {"add_generation_prompt": True}, {"continue_final_message": False}, {"echo": False},
            {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
            {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}},
            {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            {"messages": [{"role": "user", "content": "hi", "name": ""}]}]


@pytest.mark.parametrize("extra", ACCEPTED, ids=[repr(e)[:50] for e in ACCEPTED])
def test_fields_that_change_nothing_are_accepted(extra):
    """Bookkeeping fields with any value, and the fields the server cannot honour with their do-nothing value
    (store false, metadata empty, service_tier auto or default, vLLM's extensions), parse on chat."""
    parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}, 16)


REFUSED = [({"reasoning_effort": "low"}, "reasoning_effort", "enable_thinking"),
           ({"verbosity": "low"}, "verbosity", "unsupported field"),
           ({"modalities": ["text", "audio"]}, "modalities", "unsupported field"),
           ({"repetition_penalty": 1.1}, "repetition_penalty", "unsupported field"),
           ({"min_tokens": 5}, "min_tokens", "unsupported field"),
           ({"skip_special_tokens": False}, "skip_special_tokens", "unsupported field"),
           ({"include_stop_str_in_output": True}, "include_stop_str_in_output", "unsupported field"),
           ({"add_generation_prompt": False}, "add_generation_prompt", "unsupported field"),
           ({"prompt": "hi"}, "prompt", "not a field of this endpoint"),
           ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages[0].name", "ignores it"),
           ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x", "unknown"),
           ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats",
            "true or false"),
           ({"temprature": 0}, "temprature", "unknown")]

# OpenAI's own fields that promise what this server does not keep: refused by name, never "unknown".
UNSUPPORTED = [({"store": True}, "unsupported field 'store': this server does not store completions"),
               ({"metadata": {"run": "7"}}, "unsupported field 'metadata': this server does not store completions"),
               ({"service_tier": "priority"}, "unsupported field 'service_tier': this server does not have service "
                                              "tiers"),
               ({"service_tier": "flex"}, "unsupported field 'service_tier': this server does not have service tiers")]


@pytest.mark.parametrize("extra, words", UNSUPPORTED, ids=[repr(e)[:40] for e, _ in UNSUPPORTED])
def test_openais_storage_and_tier_fields_are_unsupported_not_unknown(extra, words):
    """store: true, a non-empty metadata and a service tier other than auto/default are OpenAI API fields the
    server cannot honour (it keeps no completion, has one tier): a 400 naming the field as unsupported, on
    both endpoints. Before: accepted and silently dropped, and earlier still called "unknown"."""
    (name,) = extra
    for parse, base in ((parse_chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                        (parse_completion, {"model": "m", "prompt": "hi"})):
        with pytest.raises(ApiError) as err:
            parse({**base, **extra}, 16)
        assert (err.value.status, err.value.param) == (400, name), err.value.message
        assert err.value.message.startswith(words) and "unknown" not in err.value.message, err.value.message


def test_a_made_up_field_is_still_unknown():
    """Only a field neither OpenAI's API nor vLLM defines gets the unknown-field error, on both endpoints."""
    for parse, base in ((parse_chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                        (parse_completion, {"model": "m", "prompt": "hi"})):
        with pytest.raises(ApiError) as err:
            parse({**base, "storre": True}, 16)
        assert (err.value.status, err.value.param) == (400, "storre")
        assert err.value.message == "unknown field 'storre': neither OpenAI's API nor vLLM defines it"


@pytest.mark.parametrize("extra, param, words", REFUSED, ids=[p for _, p, _ in REFUSED])
def test_what_would_change_the_output_is_refused_by_name(extra, param, words):
    """A field the server cannot honour, asking for something, is a 400 naming it (reasoning_effort points to
    chat_template_kwargs); a message's non-empty name too, since Qwen3's template never shows it to the model
    (before: silently dropped); only a field nobody defines is "unknown"."""
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}, 16)
    assert (err.value.status, err.value.param) == (400, param) and words in err.value.message, err.value.message


def test_the_groups_do_not_overlap():
    """A field is implemented, ignored or neutral: one rule each."""
    from lessons.l9_server.protocol import CHAT_FIELDS, COMPLETION_FIELDS

    implemented = COMPLETION_FIELDS | CHAT_FIELDS
    assert not (implemented & IGNORED) and not (implemented & set(NEUTRAL)) and not (IGNORED & set(NEUTRAL))


# --- live: hostile bodies, a client leaving mid-body, real clients ---------------------------------------


@pytest.fixture(scope="module")
def live():
    proc = ServerProcess(["--max-batched-tokens", "64"]).start()
    yield proc
    assert proc.stop(timeout=30) == 0


def test_serve_reports_the_backend_and_threads_its_engine_really_uses(live):
    """The line benchmarks read for their conditions: `auto` resolved to a real backend, --threads applied."""
    engine = live.engine()
    assert engine["threads"] == "1" and engine["device"] == "cpu" and engine["dtype"] == "float32"
    assert engine["backend"] not in ("", "auto"), engine


def server_log(proc: ServerProcess) -> str:
    return proc.log_text()


def hostile_bodies(model: str) -> list[tuple[str, str, bytes]]:
    ok = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2})
    return [
        ("nested JSON", "/completions", ok[:-1].encode() + b', "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("nested objects", "/chat/completions", b'{"a":' * 3000 + b"1" + b"}" * 3000),
        ("surrogate in a value", "/completions", f'{{"model": "{model}", "prompt": "\\ud800"}}'.encode()),
        ("surrogate in chat", "/chat/completions",
         f'{{"model": "{model}", "messages": [{{"role": "user", "content": "x\\udc00"}}]}}'.encode()),
        ("surrogate in a name", "/completions", ok[:-1].encode() + b', "\\ud800": 1}'),
        ("non-object JSON", "/completions", b'"just a string"'),
        ("null", "/chat/completions", b"null"),
        ("invalid UTF-8", "/completions", f'{{"model": "{model}", "prompt": "'.encode() + b'\xff\xfe"}'),
        ("huge integer", "/completions", ok[:-1].encode() + b', "max_tokens": ' + b"9" * 5000 + b"}"),
        ("huge float", "/completions", ok[:-1].encode() + b', "temperature": 1e999}'),
        ("NaN", "/completions", ok[:-1].encode() + b', "top_p": NaN}'),
        ("wrong types", "/chat/completions", f'{{"model": "{model}", "messages": {{"role": 1}}}}'.encode()),
        ("content parts of the wrong type", "/chat/completions",
         f'{{"model": "{model}", "messages": [{{"role": "user", "content": [1, null]}}]}}'.encode()),
        ("model a list", "/completions", b'{"model": ["tiny"], "prompt": "hi"}'),
        ("1 MiB + 1 body", "/completions", json.dumps({"model": model, "prompt": "x" * (1 << 20)}).encode()),
        ("1 MiB prompt of spaces", "/completions",
         json.dumps({"model": model, "prompt": " " * ((1 << 20) - 100)}).encode()),
        ("truncated", "/completions", ok[:-5].encode()),
        ("empty", "/completions", b""),
    ]


def test_hostile_bodies_are_4xx_in_openais_shape_and_leave_no_traceback(live):
    """Each hostile body gets a 4xx with OpenAI's error object, and the server's log holds no traceback.
    Before: nested JSON and surrogates were 500s (with tracebacks), one in plain text."""
    wrong = []
    with httpx.Client(timeout=TIMEOUT) as http:
        for name, path, body in hostile_bodies(live.model):
            resp = http.post(live.url + path, content=body, headers={"content-type": "application/json"})
            try:
                error_of(resp)
                ok = 400 <= resp.status_code < 500
            except (AssertionError, ValueError, KeyError):
                ok = False
            if not ok:
                wrong.append(f"{name}: {resp.status_code} {resp.text[:120]}")
    assert wrong == []
    assert "Traceback" not in server_log(live), server_log(live)[-3000:]


def test_a_client_leaving_mid_body_leaves_no_traceback(live):
    """Headers promising 1,000 bytes, then 10, then the socket closes: starlette raises ClientDisconnect in the
    handler. Before: a traceback in the log. After: nothing, and the server goes on serving."""
    host, port = live.url.removeprefix("http://").split("/")[0].split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
            time.sleep(0.2)  # the handler is reading the body when the client leaves
    resp = httpx.post(live.url + "/completions", json={"model": live.model, "prompt": "hi", "max_tokens": 1},
                      timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    time.sleep(0.5)  # the server logs what happened to the third connection by now
    assert "Traceback" not in server_log(live), server_log(live)[-3000:]


def test_the_official_clients_fields_are_accepted(live):
    """The official openai client's own fields: store, metadata, service_tier, user, include_usage and
    include_obfuscation, streamed; the usage chunk comes last, with the tokens generated."""
    with openai.OpenAI(base_url=live.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
        chunks = list(client.chat.completions.create(
            model=live.model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
            stream=True, stream_options={"include_usage": True, "include_obfuscation": False}, store=False,
            metadata={}, service_tier="auto", user="u", extra_body={"ignore_eos": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert all(c.usage is None for c in chunks[:-1])
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5, reasoning_effort="low")
        assert err.value.body["param"] == "reasoning_effort"


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(live, path):
    """vLLM's stream_options.continuous_usage_stats, as a load generator sends it, n = 2: every chunk carries
    usage, prompt_tokens constant, completion_tokens growing by the tokens that chunk's Delta brought, and the
    last chunk's usage equals the final usage chunk's. Before: a 400 (stream_options may only hold include_usage)."""
    body = {"model": live.model, "max_tokens": 6, "n": 2, "temperature": 1, "seed": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_token_ids": True}
    body |= {"prompt": "hi"} if path == "/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", live.url + path, json=body) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    counted = 0
    for c in chunks[:-1]:
        counted += sum(len(ch.get("token_ids", [])) for ch in c["choices"])
        assert c["usage"] == {"prompt_tokens": final["usage"]["prompt_tokens"], "completion_tokens": counted,
                              "total_tokens": final["usage"]["prompt_tokens"] + counted}, c
    assert chunks[-2]["usage"] == final["usage"]


def test_accepted_connections_send_without_waiting_for_acks():
    """serve.py's socket comes from socket.create_server, whose protocol number is 0, so asyncio does not turn
    Nagle's algorithm off on the connections it accepts: a response's body then waits behind its headers for
    the client's delayed ACK (44 ms a request on Linux, measured), and every SSE event behind the one before."""
    import runpy
    from pathlib import Path
    listen = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "serve.py"))["listen"]
    server = listen("127.0.0.1", 0)
    with server, socket.create_connection(server.getsockname()[:2]):
        accepted, _ = server.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_a_token_id_prompt_past_the_context_is_refused_before_its_ids_are_checked():
    """1 MiB of token ids is 200,000 of them: the length alone refuses it, before a loop over every id holds
    the event loop (the last id here is not even an integer, and the length is what the message names)."""
    from lessons.l9_server.protocol import parse_completion
    body = {"model": "m", "prompt": [100] * 200_000 + ["x"]}
    with pytest.raises(ApiError) as e:
        parse_completion(body, 16, context=4096)
    assert e.value.param == "prompt" and "200001 token ids" in e.value.message and "4096" in e.value.message

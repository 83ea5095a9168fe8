"""L13 through L9's server: `scripts/serve.py` answers `response_format` and vLLM's `structured_outputs` with
output that matches, driven with the official `openai` client.

Two servers, started at once: `main` (every server builds L13's engine now) and `ngram` (`--speculative
ngram`: prompt lookup drafts from a prompt full of JSON, most drafts are rejected, so every rejection rolls a
matcher back inside the server). Covered:
- chat and completions with a json_schema (nested object, array, enums; strict): the content parses and
  validates, finish "stop"; json_object; structured_outputs regex, choice, json and a Lark grammar; the
  streamed text equals the whole greedy text; n = 2 seeded samples both validate; a JSON cut off by max_tokens
  is "length"; a grammar's end stops a request even with ignore_eos.
- Refusals: a schema llguidance cannot compile, a bad regex, structural_tag, response_format type "xml",
  both fields at once: 400 naming the field, sent all at once beside a valid request, which finishes with its
  tokens unchanged; /health stays ok.
- /metrics: requests by kind, compiles (misses only), cache hits, compile failures, as deltas.
- Greedy over HTTP equals L13Engine run in process with the same grammar (the server adds nothing).
- The ngram server's greedy output equals the main server's, with drafts made and rejected.
- In process (the ASGI app on L9's fake runner): a compile that blocks does not stall /health or an
  unconstrained request, because it runs in a worker thread. A compile past its (shortened) deadline is a
  400 naming the field and the deadline, answered at the deadline while the compile still runs: the request
  never reaches the engine, nothing stays queued, the failure is counted, plain requests beside and after it
  complete.
"""
from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch

from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING
from lessons.l9_server.app import create_app
from lessons.l13_structured import L13Engine
from lessons.l13_structured.grammar import GrammarSpec
from lessons.l13_structured.sampling import ConstrainedSampling
from lessons.l13_structured import server as server_module
from lessons.l13_structured.server import StructuredOutputs
from shared.errors import CourseError
from shared.generation import StopRule
from shared.server_process import SERVE, ServerProcess, servers_running
from fake_runner import reference
from test_l9_streams import make_loop, run_with, served  # L9's fake-runner engine loop and ASGI helpers

sys.path.insert(0, str(SERVE.parent))
from serve import SERVER_MAX_BATCHED_TOKENS  # noqa: E402

K = 4
SERVERS = {"main": [], "ngram": ["--speculative", "ngram", "--num-speculative-tokens", str(K)]}
TIMEOUT = 60.0  # every client call: a server bug fails the test, it never hangs it
MAX_TOKENS = 80  # the bounded schema below ends within about 40 tokens on the embedded model
SCHEMA = {  # bounded everywhere (maxLength, enums, integer ranges, maxItems): the random model must end it
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "color", "point", "tags"], "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]
PROMPT = "A thing:"
# the n-gram drafter finds its matches in a prompt that already holds JSON of the schema's shape
JSON_PROMPT = ('Things: {"name":"ab","color":"red","point":{"x":1,"y":2},"tags":["a"]} '
               '{"name":"cd","color":"blue","point":{"x":3,"y":4},"tags":["b","a"]} {"name":"')
REGEX = r"[a-z]{3,6}@[a-z]{2,5}\.com"
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'
LARK_AS_REGEX = r"\([0-9]{1,2}(\+[0-9]{1,2})*\)"


# --- the servers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers():
    """All start in parallel; at the end each is stopped with SIGTERM and must exit 0."""
    with servers_running(SERVERS) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers["main"]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_chat(client, server):
    """The chat json_schema request, greedy, whole: what the streamed and the concurrent runs must equal."""
    return client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                          temperature=0, response_format=RESPONSE_FORMAT)


def metrics_of(proc: ServerProcess) -> dict[str, float]:
    text = httpx.get(proc.url.removesuffix("/v1") + "/metrics", timeout=TIMEOUT).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("paged_") and not line.split()[0].endswith("_created")}


def valid(text: str, schema: dict = SCHEMA) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# --- what the output matches ----------------------------------------------------------------------------


def test_chat_and_completions_with_a_json_schema_validate(client, server, greedy_chat):
    """response_format json_schema (strict) on chat, and the same through completions (extra_body): the text
    parses and validates, finish "stop" (the grammar ended it, not max_tokens)."""
    choice = greedy_chat.choices[0]
    valid(choice.message.content)
    assert choice.finish_reason == "stop" and greedy_chat.usage.completion_tokens < MAX_TOKENS
    done = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"response_format": RESPONSE_FORMAT})
    valid(done.choices[0].text)
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kind", ["regex", "choice", "json", "grammar"])
def test_structured_outputs_match_their_constraint(client, server, kind):
    """vLLM's structured_outputs: a regex, a choice list, a schema (json) and a Lark grammar, each greedy:
    the text matches it, finish "stop"."""
    source = {"regex": REGEX, "choice": CHOICES, "json": SCHEMA, "grammar": LARK}[kind]
    done = client.completions.create(model=server.model, prompt="Answer:", max_tokens=40, temperature=0,
                                     extra_body={"structured_outputs": {kind: source}})
    text = done.choices[0].text
    assert done.choices[0].finish_reason == "stop", text
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "json":
        valid(text)
    else:
        assert re.fullmatch(LARK_AS_REGEX, text), text


def test_json_object_gives_an_object(client, server):
    """response_format json_object on chat: any JSON object, finish "stop". (Free keys and strings let the random
    model run on to max_tokens on most prompts; on this one, greedy, it closes the object at once.)"""
    done = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=30, temperature=0,
                                          response_format={"type": "json_object"})
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content), dict)


def test_the_streamed_text_equals_the_whole_greedy_text(client, server, greedy_chat):
    """The same chat request streamed: the chunks join into the whole response's content, finish "stop"."""
    chunks = list(client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, response_format=RESPONSE_FORMAT, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == greedy_chat.choices[0].message.content and finishes == ["stop"]
    valid(text)


def test_two_seeded_samples_both_validate(client, server):
    """n = 2 at temperature 1 with a seed: each sibling has its own matcher; both outputs validate."""
    done = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0,
                                     seed=7, n=2, extra_body={"response_format": RESPONSE_FORMAT})
    assert len(done.choices) == 2
    for choice in done.choices:
        valid(choice.text)
        assert choice.finish_reason == "stop", choice.text


def test_a_json_cut_off_by_max_tokens_is_length(client, server):
    """max_tokens 5 ends the JSON early: finish "length", five tokens, text that does not parse."""
    done = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                     extra_body={"response_format": RESPONSE_FORMAT})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5
    with pytest.raises(ValueError):
        json.loads(done.choices[0].text)


def test_the_grammars_end_stops_a_request_that_ignores_eos(client, server):
    """ignore_eos with a choice list: the grammar's end (its EOS) still stops it, finish "stop", not 40 tokens
    of whatever follows."""
    done = client.completions.create(model=server.model, prompt="Answer:", max_tokens=40, temperature=0,
                                     extra_body={"structured_outputs": {"choice": CHOICES}, "ignore_eos": True})
    assert done.choices[0].text in CHOICES and done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens < 40


# --- refusals -------------------------------------------------------------------------------------------

BAD = {  # extra_body -> (the param the 400 names, a fragment of its message)
    "schema type": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
        "response_format.json_schema.schema", "json_schema cannot be compiled"),
    "regex": ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex cannot be compiled"),
    "structural_tag": ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
                       "unsupported field structured_outputs.structural_tag"),
    "xml": ({"response_format": {"type": "xml"}}, "response_format.type", "response_format.type must be one of"),
    "both": ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
             "structured_outputs", "not both"),
}


def test_bad_requests_are_400s_by_name_and_a_request_beside_them_finishes(client, server, greedy_chat):
    """Each refusal sent at the same time as a valid chat request (threads): every bad one is an
    openai.BadRequestError whose body names the field (param) and says what is wrong; the valid one gets the
    tokens it gets alone; /health is ok after them."""
    def bad(name: str):
        extra, _, _ = BAD[name]
        try:
            client.completions.create(model=server.model, prompt="x", max_tokens=4, extra_body=extra)
        except openai.BadRequestError as e:
            return e
        return None

    with ThreadPoolExecutor(1 + len(BAD)) as pool:
        good = pool.submit(client.chat.completions.create, model=server.model, messages=MESSAGES,
                           max_tokens=MAX_TOKENS, temperature=0, response_format=RESPONSE_FORMAT)
        errors = dict(zip(BAD, pool.map(bad, BAD)))
        beside = good.result(timeout=TIMEOUT)
    for name, error in errors.items():
        _, param, fragment = BAD[name]
        assert error is not None, f"{name}: accepted"
        assert error.status_code == 400 and error.body["param"] == param, (name, error.body)
        assert fragment in error.body["message"], (name, error.body)
    assert beside.choices[0].message.content == greedy_chat.choices[0].message.content
    assert beside.choices[0].finish_reason == "stop"
    health = httpx.get(server.url.removesuffix("/v1") + "/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


# --- metrics --------------------------------------------------------------------------------------------


def test_metrics_count_kinds_compiles_cache_hits_and_failures(client, server):
    """Deltas over this test's requests: a schema no other test uses, once (one compile, no hit) and again (one
    cache hit, no compile); one request of each other kind (each counted by kind); two grammars that do not
    compile (two failures, no request counted, no compile timed) and a shape refusal (it never reaches the
    compiler: no failure)."""
    fresh = {**SCHEMA, "properties": {**SCHEMA["properties"], "size": {"type": "integer", "enum": [1, 2, 3]}}}
    fresh_format = {"type": "json_schema", "json_schema": {"name": "sized", "schema": fresh}}
    snapshots = [metrics_of(server)]
    for _ in range(2):
        done = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"response_format": fresh_format})
        valid(done.choices[0].text, fresh)
        snapshots.append(metrics_of(server))
    for extra in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": REGEX}},
                  {"structured_outputs": {"choice": CHOICES}}, {"structured_outputs": {"grammar": LARK}}):
        client.completions.create(model=server.model, prompt="Answer:", max_tokens=4, temperature=0, extra_body=extra)
    snapshots.append(metrics_of(server))
    for name in ("schema type", "regex", "xml"):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=server.model, prompt="x", max_tokens=4, extra_body=BAD[name][0])
    snapshots.append(metrics_of(server))

    def delta(name: str, i: int) -> float:  # over the i-th group of requests
        return snapshots[i + 1].get(name, 0.0) - snapshots[i].get(name, 0.0)

    def kinds(i: int) -> dict[str, float]:
        return {kind: delta(f'paged_structured_requests_total{{kind="{kind}"}}', i)
                for kind in ("json_schema", "json_object", "regex", "choice", "grammar")}

    compiles, hits, failures = ("paged_grammar_compile_seconds_count", "paged_grammar_cache_hits_total",
                                "paged_grammar_compile_failures_total")
    none = {"json_schema": 0, "json_object": 0, "regex": 0, "choice": 0, "grammar": 0}
    assert (delta(compiles, 0), delta(hits, 0), kinds(0)) == (1, 0, {**none, "json_schema": 1})
    assert (delta(compiles, 1), delta(hits, 1), kinds(1)) == (0, 1, {**none, "json_schema": 1})
    assert kinds(2) == {**none, "json_object": 1, "regex": 1, "choice": 1, "grammar": 1}
    assert delta(compiles, 2) + delta(hits, 2) == 4 and delta(failures, 2) == 0
    assert (delta(failures, 3), delta(compiles, 3), delta(hits, 3), kinds(3)) == (2, 0, 0, none)


# --- exactness ------------------------------------------------------------------------------------------


def test_greedy_over_http_equals_the_engine_in_process(client, server, tiny_model, tokenizer, grammar_compiler):
    """The schema request's tokens over HTTP equal L13Engine's, run in process with the server's settings
    (block size 16, its token budget) and the grammar compiled from the same schema."""
    done = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"response_format": RESPONSE_FORMAT, "return_token_ids": True})
    engine = L13Engine(tiny_model, 16, None, DEFAULT_MAX_RUNNING, "auto", max_batched_tokens=SERVER_MAX_BATCHED_TOKENS)
    grammar = grammar_compiler.compile(GrammarSpec("json_schema", SCHEMA))
    eos = frozenset(tiny_model.config.eos_token_ids)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs
    try:
        want = engine.generate_batch([tokenizer.encode(PROMPT).ids], StopRule(MAX_TOKENS, eos, False),
                                     ConstrainedSampling(grammar=grammar))[0]
    finally:
        torch.set_num_threads(threads)
    assert done.choices[0].token_ids == want
    assert done.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)


def test_speculation_with_rejected_drafts_gives_the_same_json(servers):
    """The ngram server (K = 4), greedy, on a prompt full of the schema's JSON: it drafts, most drafts are
    rejected (each rolls the matcher back), and its tokens equal the main server's; the text validates."""
    outputs = {}
    for name in SERVERS:
        proc = servers[name]
        with openai.OpenAI(base_url=proc.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
            done = c.completions.create(model=proc.model, prompt=JSON_PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"response_format": RESPONSE_FORMAT, "return_token_ids": True})
        outputs[name] = done.choices[0]
        valid(done.choices[0].text)
        assert done.choices[0].finish_reason == "stop"
    assert outputs["ngram"].token_ids == outputs["main"].token_ids
    m = metrics_of(servers["ngram"])
    drafted, accepted = m["paged_spec_draft_tokens_total"], m["paged_spec_accepted_tokens_total"]
    assert drafted > accepted, m  # some drafts were rejected: the rollback really ran


# --- compiling off the event loop (in process) -----------------------------------------------------------


def blocking_compile_server(tokenizer, unreleased: str, released: str):
    """L9's fake-runner loop and model, and StructuredOutputs whose compile signals `entered`, then blocks until the
    test sets `release` (10 s at most) and refuses: "released" when released, "unreleased" when never."""
    loop = make_loop(tokenizer)
    model = served(tokenizer)
    structured = StructuredOutputs(tokenizer, model.vocab_size, frozenset(), loop.metrics.registry)
    entered, release = threading.Event(), threading.Event()

    def blocking_compile(spec: GrammarSpec):
        entered.set()
        raise CourseError(f"json_schema cannot be compiled: {released if release.wait(10.0) else unreleased}")

    structured.compile = blocking_compile
    return loop, model, structured, entered, release


def test_a_compile_that_blocks_stalls_neither_health_nor_other_requests(tokenizer):
    """The ASGI app in process on L9's fake runner, its StructuredOutputs' compile replaced by one that blocks
    until the test releases it. While a json_schema request waits in it, /health answers and an unconstrained
    request completes; only then is the compile released (and refused: a 400 naming the field). Had the
    compile run on the event loop, nothing would answer until its 10 s wait ran out, and its message would
    say so."""
    loop, model, structured, entered, release = blocking_compile_server(
        tokenizer, "never released (the event loop was blocked)", "released by the test")
    app = create_app(model, loop, structured=structured)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            blocked = asyncio.create_task(http.post("/v1/completions", json={
                "model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "response_format": RESPONSE_FORMAT}))
            deadline = time.monotonic() + TIMEOUT
            while not entered.is_set():
                assert time.monotonic() < deadline, "the compile never started"
                await asyncio.sleep(0.01)
            health = await http.get("/health")
            free = await http.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4,
                                                            "temperature": 0})
            release.set()
            return health, free, await blocked

    health, free, blocked = run_with(loop, main)
    assert health.status_code == 200 and free.status_code == 200, (health.text, free.text)
    assert free.json()["choices"][0]["finish_reason"] == "length"
    assert blocked.status_code == 400, blocked.text
    assert blocked.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "released by the test" in blocked.json()["error"]["message"]


def test_a_compile_past_its_deadline_is_a_400_that_frees_everything(tokenizer, monkeypatch):
    """The ASGI app in process on L9's fake runner, the deadline cut to 0.5 s and the compile replaced by one
    that blocks until the test releases it (10 s at most). The json_schema request is answered within the
    deadline (not when the compile ends) with a 400 naming the field and the deadline, while the compile still
    blocks; it never reached the engine (no submit, nothing waiting or running), the compile-failure counter
    is up by one and no structured request is counted. A plain request sent while the compile blocks, and
    another after the 400, complete with the fake runner's reference tokens."""
    monkeypatch.setattr(server_module, "COMPILE_TIMEOUT_S", 0.5)
    loop, model, structured, entered, release = blocking_compile_server(
        tokenizer, "never released (the deadline did not answer it)",
        "released by the test (the request waited for it)")
    submitted: list[list[int]] = []
    submit = loop.submit

    def spied_submit(ids, req, subscriber):
        submitted.append(list(ids))
        return submit(ids, req, subscriber)

    loop.submit = spied_submit
    app = create_app(model, loop, structured=structured)
    slow_prompt, plain = [9, 8, 7], {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0,
                                     "return_token_ids": True}

    def value(name: str, labels: dict | None = None) -> float:
        return loop.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    failures, kinds = "paged_grammar_compile_failures_total", "paged_structured_requests_total"

    async def main():
        before = value(failures)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app",
                                         timeout=TIMEOUT) as http:
                start = time.monotonic()
                slow = asyncio.create_task(http.post("/v1/completions", json={
                    "model": "m", "prompt": slow_prompt, "max_tokens": 4, "response_format": RESPONSE_FORMAT}))
                while not entered.is_set():
                    assert time.monotonic() < start + TIMEOUT, "the compile never started"
                    await asyncio.sleep(0.01)
                beside = await http.post("/v1/completions", json=plain)
                refused = await slow
                waited, still_blocked = time.monotonic() - start, not release.is_set()
                after = await http.post("/v1/completions", json=plain)
                def state():
                    return (loop.num_waiting, len(loop.jobs), value("paged_requests_running"),
                            value("paged_requests_waiting"))

                settle = time.monotonic() + 5.0  # the engine thread sets the gauges after the step that ended it
                while state() != (0, 0, 0, 0) and time.monotonic() < settle:
                    await asyncio.sleep(0.01)
                return beside, refused, waited, still_blocked, after, state(), value(failures) - before
        finally:
            release.set()  # the compile's thread ends either way

    beside, refused, waited, still_blocked, after, state, failed = run_with(loop, main)
    assert refused.status_code == 400, \
        f"expected a 400 for the compile past its deadline, got {refused.status_code}: {refused.text}"
    error = refused.json()["error"]
    assert error["param"] == "response_format.json_schema.schema", f"expected the schema's field, got {error}"
    assert error["message"] == "the json_schema took more than 0.5 s to compile", \
        f"expected the deadline's message, got {error['message']!r}"
    assert still_blocked and waited < 5.0, \
        f"expected the 400 within the 0.5 s deadline while the compile still blocked, got it after {waited:.1f} s"
    assert slow_prompt not in submitted, f"the refused request reached the engine: submitted {submitted}"
    assert state == (0, 0, 0, 0), f"expected nothing waiting, queued or running after, got (num_waiting, jobs, " \
                                  f"running, waiting) = {state}"
    assert failed == 1, f"expected the compile-failure counter up by 1, got {failed}"
    counted = {k: value(kinds, {"kind": k}) for k in ("json_schema", "json_object", "regex", "choice", "grammar")}
    assert not any(counted.values()), f"expected no structured request counted, got {counted}"
    for name, resp in (("beside the compile", beside), ("after the 400", after)):
        assert resp.status_code == 200, f"the plain request {name}: expected 200, got {resp.status_code}: {resp.text}"
        choice = resp.json()["choices"][0]
        assert (choice["token_ids"], choice["finish_reason"]) == (reference([1, 2, 3], 4), "length"), \
            f"the plain request {name}: expected the reference tokens {reference([1, 2, 3], 4)} and \"length\", " \
            f"got {choice['token_ids']} and {choice['finish_reason']!r}"
    assert submitted == [[1, 2, 3], [1, 2, 3]], f"expected the two plain requests submitted, got {submitted}"

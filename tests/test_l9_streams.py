"""L9's streams under a reader that lags, leaves early, or outlives its engine (issue 27).

- A subscriber fed 10,000 Deltas of 3 choices with no reader holds a bounded number of entries (Deltas of
  one choice merged once MERGE_AFTER wait); the reader then gets, per choice, exactly the text and tokens
  sent, in order, one finish reason at the end, then Finished.
- A reader more than max_lag tokens behind in one choice is cut once: on_lag runs, a Failed (code
  slow_reader) follows what waits, nothing after it.
- In process, through the ASGI app on the fake runner: a client that leaves while the response's headers
  go out (before the stream's generator first runs) gets its request aborted, not decoded to max_tokens.
- An engine that fails mid-stream: the client gets its chunks (the reference's tokens), then exactly one
  error event in OpenAI's shape, then `data: [DONE]`, then the end of the body.
- A client whose socket fills (its sends block, as uvicorn's do for a client that does not read) and that
  never reads again: the buffer stays bounded while Deltas merge, the stream is cut past MAX_STREAM_LAG
  (counted in /metrics, one line in the log), its request aborted; /health answers meanwhile. (Over a real
  loopback socket the kernel takes about 3 MB before a send blocks, even with a 4 KiB receive buffer:
  some 17,000 chunks, minutes of the tiny model on a CPU; the harness's send blocks after 3 chunks instead.)
- stream_options.continuous_usage_stats without return_token_ids, on a runner scripted to emit é and 🙂 one
  byte-level token at a time: a token that completes no character sends no chunk, and the next chunk's usage
  counts it (every chunk's completion_tokens is every token generated up to it).
- finish_reason as a client reads it, whole and streamed, when the max_tokens-th token is EOS: "length" with
  ignore_eos (the EOS was only a token), "stop" without.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
import torch

from fake_runner import FakeChunkRunner, fake_model, reference
from lessons.l9_server import app as app_module
from lessons.l9_server.app import ServedModel, create_app
from lessons.l9_server.detokenizer import TokenBytes, _unicode_to_byte
from lessons.l9_server.engine import L9Engine
from lessons.l9_server.engine_loop import Accepted, Delta, EngineLoop, EventBuffer, Failed, Finished, Subscriber
from lessons.l9_server.metrics import ServerMetrics
from lessons.l9_server.protocol import parse_completion
from test_l9_tasks import eos_last

TIMEOUT = 20.0


class FakeL9(L9Engine):
    runner_class = FakeChunkRunner


def make_loop(tokenizer, num_blocks: int = 300, eos: frozenset[int] = frozenset()) -> EngineLoop:
    engine = FakeL9(fake_model(), 16, num_blocks, graphs=False, max_batched_tokens=64)
    return EngineLoop(engine, TokenBytes(tokenizer), ServerMetrics(), eos, 8)


def finished(loop: EngineLoop, reason: str) -> float:
    return loop.metrics.registry.get_sample_value("paged_requests_finished_total", {"reason": reason}) or 0.0


# --- the buffer, without an engine ---


def test_10000_deltas_unread_are_merged_and_read_back_exactly():
    """10,000 Deltas of 3 choices (random texts and 1-3 tokens each, the last of each choice with finish
    "length"), sent from another thread with no reader: the buffer holds at most MERGE_AFTER + 3 Deltas
    + Accepted + Finished. Then the reader gets per choice the same text and tokens, in order, a finish
    reason only on its last Delta, and Finished last."""
    rng = random.Random(27)
    sent = [(i % 3, "".join(rng.choice("ab東🙂 ") for _ in range(rng.randint(0, 3))),
             [rng.randrange(1000) for _ in range(rng.randint(1, 3))]) for i in range(10_000)]

    async def main():
        sub = Subscriber(asyncio.get_running_loop())

        def engine_thread():
            sub.put(Accepted(5))
            for k, (index, text, ids) in enumerate(sent):
                sub.put(Delta(index, text, list(ids), "length" if k >= len(sent) - 3 else None))
            sub.put(Finished(5, sum(len(ids) for _, _, ids in sent)))

        await asyncio.to_thread(engine_thread)
        await asyncio.sleep(0.05)  # every call_soon_threadsafe scheduled by the thread has run
        held = sub.events.qsize()
        got = []
        while not got or not isinstance(got[-1], Finished):
            got.append(await asyncio.wait_for(sub.events.get(), TIMEOUT))
        return held, got

    held, got = asyncio.run(main())
    assert held <= EventBuffer.MERGE_AFTER + 3 + 2, held
    assert got[0] == Accepted(5) and got[-1] == Finished(5, sum(len(ids) for _, _, ids in sent))
    for index in range(3):
        mine = [d for d in got[1:-1] if d.index == index]
        assert "".join(d.text for d in mine) == "".join(t for i, t, _ in sent if i == index)
        assert [t for d in mine for t in d.token_ids] == [t for i, _, ids in sent if i == index for t in ids]
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + ["length"]


@pytest.mark.task("L9.6")
def test_a_reader_too_far_behind_is_cut_once():
    """max_lag 100: the 101st unread token of choice 0 cuts the reader: on_lag runs once, the Deltas
    waiting (100 tokens) are kept, a Failed with code slow_reader follows, and later Deltas and Finished
    are dropped. A reader that takes its Deltas as they come is never cut."""
    async def main():
        behind = EventBuffer()
        calls = []
        behind.max_lag, behind.on_lag = 100, lambda: calls.append(1)
        for t in range(150):
            behind.push(Delta(0, "x", [t]))
        behind.push(Finished(1, 150))
        events = [behind.get_nowait() for _ in range(behind.qsize())]

        keeping_up = EventBuffer()
        keeping_up.max_lag, keeping_up.on_lag = 100, lambda: calls.append(2)
        for t in range(1000):
            keeping_up.push(Delta(0, "x", [t]))
            assert (await keeping_up.get()).token_ids == [t]
        return calls, events

    calls, events = asyncio.run(main())
    assert calls == [1]
    assert [t for e in events[:-1] for t in e.token_ids] == list(range(100))
    assert isinstance(events[-1], Failed) and events[-1].error.code == "slow_reader"
    assert events[-1].error.body()["error"]["type"] == "server_error"


# --- the ASGI app in process, on the fake runner ---


class Client:
    """One request through the ASGI app, as uvicorn calls it (ASGI 2.3: Starlette listens for the disconnect
    beside the stream). The client leaves when `leave` is set; `leave_at_headers` sets it while the
    response's headers go out, before the stream's generator has run. `stall_after`: after that many body
    messages every send blocks, as uvicorn's does when the socket's buffers are full (a client not reading)."""

    def __init__(self, body: dict | None, leave_at_headers: bool = False, stall_after: int | None = None):
        self.body = b"" if body is None else json.dumps(body).encode()
        self.leave_at_headers, self.stall_after = leave_at_headers, stall_after
        self.sent: list[dict] = []
        self._body_read = False
        self.leave = asyncio.Event()

    async def receive(self) -> dict:
        if not self._body_read:
            self._body_read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.start" and self.leave_at_headers:
            self.leave.set()
            await asyncio.sleep(0.2)  # the headers take a while to go out; the client leaves meanwhile
        bodies = sum(m["type"] == "http.response.body" for m in self.sent)
        if self.stall_after is not None and bodies >= self.stall_after:
            await asyncio.Event().wait()  # the socket is full: this send returns only when cancelled

    async def call(self, app, path: str = "/v1/completions", method: str = "POST") -> None:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(self.body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await asyncio.wait_for(app(scope, self.receive, self.send), 3 * TIMEOUT)

    def text(self) -> str:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body").decode()


def served(tokenizer) -> ServedModel:
    return ServedModel("m", tokenizer, None, 4096, fake_model().config.vocab_size)


def run_with(loop: EngineLoop, coro_fn):
    async def main():
        loop.start()
        return await coro_fn()
    try:
        return asyncio.run(asyncio.wait_for(main(), 3 * TIMEOUT))
    finally:
        loop.stop(TIMEOUT)


def test_a_client_that_leaves_before_the_stream_starts_aborts_it(tokenizer):
    """The client leaves while the headers go out, so Starlette cancels the response before the stream's
    generator ever runs (its `finally` never would). The request must still be aborted: the abort is
    counted, "length" never, and the engine drains long before the 2,000 tokens asked for."""
    loop = make_loop(tokenizer)
    app = create_app(served(tokenizer), loop)

    async def main():
        client = Client({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2000, "stream": True,
                         "ignore_eos": True}, leave_at_headers=True)
        await client.call(app)
        deadline = time.monotonic() + TIMEOUT
        while loop.jobs or loop.engine.scheduler.has_work():
            assert time.monotonic() < deadline, "the request still runs"
            await asyncio.sleep(0.01)
        return client

    client = run_with(loop, main)
    assert client.sent[0]["status"] == 200 and client.text() == ""
    assert finished(loop, "abort") == 1 and finished(loop, "length") == 0


def test_an_engine_failing_mid_stream_sends_one_error_event_then_done(tokenizer):
    """The engine's 4th step raises: the stream carries the first 3 tokens of the reference, then exactly
    one error event in OpenAI's shape ({"error": {message, type, param, code}}), then `data: [DONE]`,
    then the body ends."""
    loop = make_loop(tokenizer)
    step, steps = loop.engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("device lost")
        return step()

    loop.engine.step = failing_step
    app = create_app(served(tokenizer), loop)
    client = Client({"model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "stream": True, "temperature": 0,
                     "return_token_ids": True})
    run_with(loop, lambda: client.call(app))
    raw = client.text()
    assert raw.endswith("\n\ndata: [DONE]\n\n") and client.sent[-1]["more_body"] is False
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in raw.split("\n\n") if e)
    chunks, error, done = [json.loads(e) for e in events[:-2]], json.loads(events[-2]), events[-1]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reference([1, 2, 3], 3)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert error == {"error": {"message": "RuntimeError: device lost", "type": "server_error", "param": None,
                               "code": None}}
    assert done == "[DONE]"


def test_a_client_that_never_reads_is_cut_with_its_buffer_bounded(tokenizer, monkeypatch, capsys):
    """n = 2, 400 tokens asked for (ignore_eos); the client's socket fills after 3 chunks and it never reads
    again. The Deltas merge while it stalls: the buffer never holds more than MERGE_AFTER + 2 Deltas +
    Accepted + the final event. Past MAX_STREAM_LAG tokens of one choice (40 here: the fake runner takes
    tens of milliseconds a token) the stream is cut: slow readers 1,
    the request aborted (never run to "length") and the engine drained, one line in the log; /health
    answers 200 meanwhile. When the client finally leaves, the abort is not counted twice."""
    subscribers, most = [], [0]
    init = Subscriber.__init__

    def recorded(self: Subscriber, *args) -> None:
        init(self, *args)
        subscribers.append(self)

    monkeypatch.setattr(Subscriber, "__init__", recorded)
    monkeypatch.setattr(app_module, "MAX_STREAM_LAG", 40)
    loop = make_loop(tokenizer)
    app = create_app(served(tokenizer), loop)

    async def main():
        client = Client({"model": "m", "prompt": [1, 2, 3], "max_tokens": 400, "n": 2, "stream": True,
                         "ignore_eos": True}, stall_after=3)
        task = asyncio.create_task(client.call(app))
        deadline = time.monotonic() + 3 * TIMEOUT
        while not task.done() and (not subscribers or loop.jobs or loop.engine.scheduler.has_work()):
            assert time.monotonic() < deadline, "the request still runs"
            most.append(max((s.events.qsize() for s in subscribers), default=0))
            await asyncio.sleep(0.01)
        health = Client(None)
        await health.call(app, "/health", "GET")
        client.leave.set()
        await task
        return health

    health = run_with(loop, main)
    assert max(most) <= EventBuffer.MERGE_AFTER + 2 + 2, max(most)
    assert health.sent[0]["status"] == 200
    assert loop.metrics.registry.get_sample_value("paged_slow_readers_total") == 1
    assert finished(loop, "abort") == 2 and finished(loop, "length") == 0  # its 2 choices, one stream cut
    assert "request 0: its client fell 40 tokens behind the stream; aborted (slow reader)" in capsys.readouterr().err


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("ignore_eos,reason", [(True, "length"), (False, "stop")])
def test_an_ignored_eos_at_max_tokens_finishes_with_length_over_http(tokenizer, stream, ignore_eos, reason):
    """What a client reads: max_tokens 6 and the 6th token is the server's EOS id. With ignore_eos the response's
    finish_reason is "length" (max_tokens ran out; the EOS was only a token); without it "stop", on the same six
    tokens. Whole responses and streams alike."""
    prompt, want = eos_last(6)
    loop = make_loop(tokenizer, eos=frozenset({want[-1]}))
    app = create_app(served(tokenizer), loop)
    client = Client({"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": ignore_eos,
                     "return_token_ids": True, "stream": stream})
    run_with(loop, lambda: client.call(app))
    assert client.sent[0]["status"] == 200, client.text()
    if stream:
        events = [e.removeprefix("data: ") for e in client.text().split("\n\n") if e]
        assert events[-1] == "[DONE]"
        choices = [json.loads(e)["choices"][0] for e in events[:-1]]
        tokens = [t for c in choices for t in c["token_ids"]]
        finishes = [c["finish_reason"] for c in choices]
        assert finishes[-1] == reason and set(finishes[:-1]) == {None}, f"ignore_eos={ignore_eos}: {finishes}"
    else:
        [choice] = json.loads(client.text())["choices"]
        tokens = choice["token_ids"]
        assert choice["finish_reason"] == reason, f"ignore_eos={ignore_eos}: {choice['finish_reason']!r}"
    assert tokens == want, "six tokens, the last of them the EOS id"


# --- the engine off the event loop ---


def test_the_event_loop_answers_while_a_step_runs(tokenizer):
    """The first step (a long prefill, say) waits until /health has answered while it runs; were engine.step()
    called on the event loop (in an async handler), no request could be answered until the step ended, so it
    would wait out its 5 s and find no answer: every client stalls for the whole step (docs/l9_server.md, pitfall
    3). No timing is judged: the step records whether an answer came while it held the engine."""
    loop = make_loop(tokenizer)
    step, started, answered, seen = loop.engine.step, threading.Event(), threading.Event(), []

    def slow_first_step():
        if not started.is_set():
            started.set()
            seen.append(answered.wait(timeout=5.0))  # set by a /health answer given while this step runs
        return step()

    loop.engine.step = slow_first_step
    app = create_app(served(tokenizer), loop)

    async def main():
        request = Client({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
        task = asyncio.create_task(request.call(app))
        while not task.done():
            health = Client(None)
            await health.call(app, "/health", "GET")
            assert health.sent[0]["status"] == 200, health.sent[0]
            if started.is_set():
                answered.set()
            await asyncio.sleep(0.02)
        await task
        return request

    request = run_with(loop, main)
    assert request.sent[0]["status"] == 200 and seen, "the request and its first step ran"
    assert seen == [True], ("no /health answer while the first step ran: the step blocked the event loop; "
                            "engine.step() runs on the engine thread, never in an async handler")


# --- fewer wake-ups and fewer writes (issue 28) ---


def test_the_engine_thread_wakes_the_event_loop_once_per_pass_not_once_per_event(tokenizer):
    """4 requests of 4 tokens each: 24 events (Accepted, 4 Deltas, Finished per request) reach their
    buffers, in order, through at most one call_soon_threadsafe per engine step plus one per drain of the
    inbox that admitted something (4 submits: at most 4), never one per event."""
    loop = make_loop(tokenizer)
    steps, calls = [], []
    step = loop.engine.step

    def counted_step():
        steps.append(1)
        return step()

    loop.engine.step = counted_step

    async def main():
        aio = asyncio.get_running_loop()
        call_soon_threadsafe = aio.call_soon_threadsafe

        def counted(*args, **kwargs):
            calls.append(1)
            return call_soon_threadsafe(*args, **kwargs)

        aio.call_soon_threadsafe = counted
        subs = [Subscriber(aio) for _ in range(4)]
        for k, sub in enumerate(subs):
            prompt = [1 + k, 2, 3]
            loop.submit(prompt, parse_completion({"model": "m", "prompt": prompt, "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True}, 16), sub)
        got = []
        for sub in subs:
            mine = [await asyncio.wait_for(sub.events.get(), TIMEOUT)]
            while not isinstance(mine[-1], (Finished, Failed)):
                mine.append(await asyncio.wait_for(sub.events.get(), TIMEOUT))
            got.append(mine)
        return got

    got = run_with(loop, main)
    for k, events in enumerate(got):
        assert events[0] == Accepted(3) and events[-1] == Finished(3, 4)
        assert [t for d in events[1:-1] for t in d.token_ids] == reference([1 + k, 2, 3], 4)
    assert sum(map(len, got)) == 24
    assert len(calls) <= len(steps) + 4 < 24, (len(calls), len(steps))


def test_a_stream_sends_what_waits_in_one_write(tokenizer):
    """n = 2, include_usage: a step's Deltas of both choices arrive together and leave in one body message
    (a reader slower than the engine gets several steps in one), and the last message carries both finish
    chunks, the usage chunk and [DONE] together (one write, not four)."""
    loop = make_loop(tokenizer)
    app = create_app(served(tokenizer), loop)
    client = Client({"model": "m", "prompt": [1, 2, 3], "max_tokens": 6, "n": 2, "stream": True,
                     "temperature": 1.0, "seed": 5, "ignore_eos": True, "return_token_ids": True,
                     "stream_options": {"include_usage": True}})
    run_with(loop, lambda: client.call(app))
    writes = [m["body"].decode() for m in client.sent if m["type"] == "http.response.body" and m.get("body")]
    events = [[e.removeprefix("data: ") for e in w.split("\n\n") if e] for w in writes]
    chunks = [[json.loads(e) for e in w if e != "[DONE]"] for w in events]
    assert events[-1][-1] == "[DONE]" and all("[DONE]" not in w for w in events[:-1])
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for w in chunks for c in w
                if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    last = chunks[-1]
    assert sum(c["choices"][0]["finish_reason"] == "length" for c in last if c["choices"]) == 2
    assert last[-1]["choices"] == [] and last[-1]["usage"]["completion_tokens"] == 12
    for write in chunks:  # both choices advance in every step (a slow reader's write holds several steps)
        assert {c["choices"][0]["index"] for c in write if c["choices"]} == {0, 1}, write
    assert sum(len(c["choices"][0]["token_ids"]) for w in chunks for c in w if c["choices"]) == 12


# --- continuous_usage_stats and tokens that make no text yet ---


def byte_token(tokenizer, byte: int) -> int:
    """The id of the byte-level token that stands for one byte alone."""
    char = next(c for c, b in _unicode_to_byte().items() if b == byte)
    return tokenizer.token_to_id(char)


def test_continuous_usage_counts_the_tokens_of_a_character_not_yet_shown(tokenizer):
    """A runner scripted to emit "a", é as two byte tokens, "b", 🙂 as four, "c" (9 tokens, greedy); streamed
    with include_usage and continuous_usage_stats, without return_token_ids. A token that only starts a character
    makes no text, so no chunk (the app's rule, as vLLM's); the chunk that shows the character counts it: every
    chunk's completion_tokens is all the tokens generated up to it (responses.py: "those generated up to that
    chunk"), never only the tokens that made text, and the last text chunk's usage equals the final one's."""
    script = [tokenizer.token_to_id("a"), *(byte_token(tokenizer, b) for b in "é".encode()),
              tokenizer.token_to_id("b"), *(byte_token(tokenizer, b) for b in "🙂".encode()),
              tokenizer.token_to_id("c")]
    assert len(script) == 9 and None not in script, script
    width = max(script) + 1

    class ScriptedRunner(FakeChunkRunner):
        """The fake runner's KV, and logits that pick the script's next token for each sampled row."""

        def forward(self, slices) -> torch.Tensor:
            outputs = [len(s.output_ids) for s in slices if s.samples]  # before: forward advances the slices
            super().forward(slices)
            logits = torch.zeros(len(outputs), width)
            for row, done in enumerate(outputs):
                logits[row, script[done]] = 10.0
            return logits

    class ScriptedL9(L9Engine):
        runner_class = ScriptedRunner

    engine = ScriptedL9(fake_model(), 16, 300, graphs=False, max_batched_tokens=64)
    loop = EngineLoop(engine, TokenBytes(tokenizer), ServerMetrics(), frozenset(), 8)
    app = create_app(served(tokenizer), loop)
    client = Client({"model": "m", "prompt": [1, 2, 3], "max_tokens": len(script), "stream": True,
                     "temperature": 0, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    run_with(loop, lambda: client.call(app))
    events = [e.removeprefix("data: ") for e in client.text().split("\n\n") if e]
    assert events[-1] == "[DONE]", events[-1]
    chunks = [json.loads(e) for e in events[:-1]]
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"] == {"prompt_tokens": 3, "completion_tokens": 9,
                                                         "total_tokens": 12}, f"the final usage chunk: {final}"
    got = [(c["choices"][0]["text"], c["usage"]["completion_tokens"]) for c in chunks[:-1]]
    want = [("a", 1), ("é", 3), ("b", 4), ("🙂", 8), ("c", 9)]
    assert got == want, f"expected (text, completion_tokens) per chunk {want}, got {got}"
    assert all(c["usage"]["prompt_tokens"] == 3 and c["usage"]["total_tokens"] == 3 + n
               for c, (_, n) in zip(chunks, got)), [c["usage"] for c in chunks]

"""L9's failure paths: nothing waits for ever, and every failure reaches every request (issue 27).

- The engine thread failing at each point of its loop (its first metrics update, a step, the emit after
  it, a later metrics update, admitting a request): every request in flight and every one still in the
  inbox gets Failed (503, naming the error), and later submissions are refused with 503.
- A submission racing the failure (past submit's checks, not yet in the inbox, when the thread makes its
  final drain): answered too, because submit and the final drain share one lock.
- A handler waiting for its first event whose client leaves: it aborts the request and returns.
- max_waiting counts sequences (n per request, unforked siblings included), and n > max_waiting is a 400.
- Pins: finish_reason "length" when ignore_eos lets an EOS token pass; /metrics' counters equal what the
  engine did, each event once, through preemptions, forks and an abort.
- SIGTERM with long requests open past --shutdown-timeout: a 503 for each (in-band on a stream), exit 0.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from fake_runner import reference
from lessons.l4_continuous.sequence import Status
from lessons.l9_server.app import ServedModel, create_app
from lessons.l9_server.engine_loop import Accepted, Delta, EngineLoop, Failed, Finished, Subscriber
from shared.server_process import ServerProcess
from lessons.l9_server.protocol import ApiError
from test_l9_units import (TIMEOUT, completion, events_until_end, make_loop, record_sequences, run_async,  # noqa: F401
                           token_bytes)

# Slow (real servers sent SIGTERM and left past their grace period).
pytestmark = pytest.mark.slow

# --- the engine thread failing -----------------------------------------------------------------------------


def inject(loop: EngineLoop, point: str) -> None:
    """Make the engine thread raise RuntimeError("boom") at `point`, once."""
    def once(fn, calls_before: int = 0):
        calls = [0]

        def wrapped(*args, **kwargs):
            calls[0] += 1
            if calls[0] == calls_before + 1:
                raise RuntimeError("boom")
            return fn(*args, **kwargs)
        return wrapped

    if point == "first metrics update":
        loop.metrics.update = once(loop.metrics.update)
    elif point == "step":
        loop.engine.step = once(loop.engine.step, calls_before=3)
    elif point == "emit":
        loop._emit = once(loop._emit, calls_before=3)
    elif point == "later metrics update":
        loop.metrics.update = once(loop.metrics.update, calls_before=4)
    elif point == "admit":
        loop.engine.add_parallel = once(loop.engine.add_parallel, calls_before=1)  # the second request's


@pytest.mark.parametrize("point", ["first metrics update", "step", "emit", "later metrics update", "admit"])
def test_a_failure_anywhere_in_the_loop_reaches_every_request(token_bytes, point):
    """Two long requests (the second n = 2) queued before the thread starts, then the failure: each gets
    Failed, 503, naming RuntimeError: boom (after an Accepted and some Deltas, or first), within the
    deadline; the thread has ended, nothing is tracked, and a later submit is a 503 naming the failure.
    (Before the fix, a failure in the first metrics update, or in admitting a request, left requests with
    no answer at all.)"""
    loop = make_loop(token_bytes)
    inject(loop, point)

    async def main():
        aio = asyncio.get_running_loop()
        subs = [Subscriber(aio), Subscriber(aio)]
        loop.submit([1, 2, 3], completion([1, 2, 3], max_tokens=1000, temperature=0), subs[0])
        loop.submit([4, 5], completion([4, 5], max_tokens=1000, temperature=1.0, n=2), subs[1])
        loop.start()
        ends = [await events_until_end(s) for s in subs]
        with pytest.raises(ApiError) as err:
            loop.submit([1], completion([1], max_tokens=1, temperature=0), Subscriber(aio))
        return ends, err.value

    ends, refused = run_async(main, loop)
    for events in ends:
        last = events[-1]
        assert isinstance(last, Failed), events[-3:]
        assert last.error.status == 503 and last.error.message == "RuntimeError: boom", last.error.message
        assert all(isinstance(e, (Accepted, Delta)) for e in events[:-1])
    assert not loop.thread.is_alive() and loop.jobs == {}
    assert refused.status == 503 and "RuntimeError: boom" in refused.message


def test_a_submit_racing_the_failure_is_answered(token_bytes):
    """The first step waits until a second submission is inside submit, past its checks, about to put its
    job in the inbox; then the step raises. The submission waits (up to 1 s) for the engine thread to end
    before putting. Both requests get Failed 503. (Before the fix the thread made its final drain while the
    job was not yet in the inbox, ended, and the job was never answered.)"""
    loop = make_loop(token_bytes)
    inside_submit = threading.Event()

    def failing_step():
        assert inside_submit.wait(TIMEOUT)
        raise RuntimeError("boom")

    loop.engine.step = failing_step
    put = loop.inbox.put

    def racing_put(item, *args, **kwargs):
        if item[0] == "submit" and item[2].prompt_ids == [9]:
            inside_submit.set()
            loop.thread.join(1.0)  # the fixed code holds the lock here, so the thread cannot end yet
        put(item, *args, **kwargs)

    loop.inbox.put = racing_put

    async def main():
        aio = asyncio.get_running_loop()
        first, racer = Subscriber(aio), Subscriber(aio)
        loop.start()
        loop.submit([1, 2], completion([1, 2], max_tokens=100, temperature=0), first)
        assert await asyncio.wait_for(first.events.get(), TIMEOUT) == Accepted(2)
        await asyncio.to_thread(loop.submit, [9], completion([9], max_tokens=5, temperature=0), racer)
        return await events_until_end(first), await events_until_end(racer)

    first, racer = run_async(main, loop)
    for events in (first, racer):
        assert isinstance(events[-1], Failed) and events[-1].error.status == 503, events
        assert events[-1].error.message == "RuntimeError: boom"


def test_a_client_leaving_before_its_first_event_frees_the_handler(tokenizer, token_bytes):
    """The app called directly (ASGI), with an engine thread that never starts, so no first event ever
    comes: once the client disconnects, the handler aborts the request (an abort in the inbox after the
    submission) and returns 499. (Before the fix it waited for the first event for ever.)"""
    loop = make_loop(token_bytes)
    app = create_app(ServedModel("m", tokenizer, None, 4096, 64), loop)
    body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}).encode()
    sent: list[dict] = []

    async def main():
        client_left = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await client_left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        handler = asyncio.create_task(app(scope, receive, send))
        while loop.inbox.qsize() < 1:  # submitted: the handler now waits for its first event
            await asyncio.sleep(0.01)
        client_left.set()
        await asyncio.wait_for(handler, TIMEOUT)

    asyncio.run(main())
    kinds = []
    while not loop.inbox.empty():
        kinds.append(loop.inbox.get_nowait()[:2])
    assert kinds == [("submit", 0), ("abort", 0)]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499


# --- max_waiting counts sequences --------------------------------------------------------------------------


def test_max_waiting_counts_each_of_n_choices(token_bytes):
    """max_waiting 4, thread not started: n = 3 is queued (3 waiting); n = 2 more is a 429; n = 1 fits (4).
    A request of n = 5 can never fit: a 400 naming n, not a 429 to retry for ever. Once started, all
    finish."""
    loop = make_loop(token_bytes, max_waiting=4)

    async def main():
        aio = asyncio.get_running_loop()
        three, one = Subscriber(aio), Subscriber(aio)
        loop.submit([1, 2], completion([1, 2], max_tokens=2, temperature=1.0, n=3), three)
        assert loop.num_waiting == 3
        with pytest.raises(ApiError) as busy:
            loop.submit([1, 2], completion([1, 2], max_tokens=2, temperature=1.0, n=2), Subscriber(aio))
        loop.submit([3], completion([3], max_tokens=2, temperature=0), one)
        assert loop.num_waiting == 4
        with pytest.raises(ApiError) as never:
            loop.submit([1], completion([1], max_tokens=2, temperature=1.0, n=5), Subscriber(aio))
        loop.start()
        return busy.value, never.value, await events_until_end(three), await events_until_end(one)

    busy, never, three, one = run_async(main, loop)
    assert (busy.status, busy.kind) == (429, "rate_limit_error")
    assert (never.status, never.param) == (400, "n") and "n (5)" in never.message
    assert three[-1] == Finished(2, 6) and one[-1] == Finished(1, 2) and loop.num_waiting == 0


def test_unforked_siblings_in_the_scheduler_count_as_waiting(token_bytes):
    """max_running 1: a long request runs, and an n = 3 request waits in the scheduler as one parent
    holding two unforked siblings: 3 sequences waiting. With max_waiting 4, n = 2 more is a 429."""
    loop = make_loop(token_bytes, max_waiting=4, max_running=1)

    async def main():
        aio = asyncio.get_running_loop()
        loop.start()
        runner, three = Subscriber(aio), Subscriber(aio)
        loop.submit([1, 2], completion([1, 2], max_tokens=1000, temperature=0), runner)
        assert await asyncio.wait_for(runner.events.get(), TIMEOUT) == Accepted(2)
        loop.submit([5, 6], completion([5, 6], max_tokens=2, temperature=1.0, n=3), three)
        assert await asyncio.wait_for(three.events.get(), TIMEOUT) == Accepted(2)
        deadline = time.monotonic() + TIMEOUT
        while loop._in_inbox or not loop._engine_waiting:  # a step has run since the admission
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        waiting = loop.num_waiting
        with pytest.raises(ApiError) as busy:
            loop.submit([1], completion([1], max_tokens=2, temperature=1.0, n=2), Subscriber(aio))
        return waiting, busy.value

    waiting, busy = run_async(main, loop)
    assert waiting == 3 and busy.status == 429


# --- pins ----------------------------------------------------------------------------------------------------


def test_ignore_eos_finishes_with_length_even_when_the_last_token_is_eos(token_bytes):
    """EOS ids: the reference's 3rd and 10th tokens. With ignore_eos and max_tokens 10, the choice runs
    through the 3rd (an EOS it ignores) to the 10th (an EOS again, and the last): finish "length", 10 tokens.
    Without ignore_eos it ends after 3 with "stop" (so EOS really was sampled)."""
    prompt = next([k, 8] for k in range(64) if reference([k, 8], 10)[2] not in reference([k, 8], 10)[:2])
    want = reference(prompt, 10)
    eos = frozenset({want[2], want[9]})
    ends = {}
    for ignore in (True, False):
        loop = make_loop(token_bytes, eos=eos)

        async def main():
            loop.start()
            sub = Subscriber(asyncio.get_running_loop())
            loop.submit(prompt, completion(prompt, max_tokens=10, temperature=0, ignore_eos=ignore), sub)
            return await events_until_end(sub)

        ends[ignore] = run_async(main, loop)
    assert ends[True][-1] == Finished(2, 10) and ends[True][-2].finish_reason == "length"
    assert [t for d in ends[True][1:-1] for t in d.token_ids] == want
    assert ends[False][-1] == Finished(2, 3) and ends[False][-2].finish_reason == "stop"


def metric(loop: EngineLoop, name: str, **labels) -> float:
    return loop.metrics.registry.get_sample_value(name, labels) or 0.0


def test_metrics_count_each_event_once_through_preemptions_forks_and_an_abort(token_bytes):
    """A 24-block pool of 4-token blocks, so requests preempt each other: two greedy requests, an n = 3
    one (forked after its prefill), and a long n = 2 one aborted after its 3rd Delta. Afterwards: the
    preemption counter equals the engine's own count (and is above 0); "length" counts each of the 5 choices
    that ran to max_tokens once (a finish reason is a choice's); "abort" counts the aborted request's 2
    choices (per choice too, so the reasons add up); the first-token histogram has one entry per choice that produced a token,
    the inter-token one one per later token; the hit-rate gauge is the engine's cached / prompt tokens; the
    pool gauges show it idle."""
    loop = make_loop(token_bytes, num_blocks=24, budget=16)
    created = record_sequences(loop.engine)

    async def main():
        aio = asyncio.get_running_loop()
        loop.start()
        subs = [Subscriber(aio) for _ in range(3)]
        doomed = Subscriber(aio)
        doomed_id = loop.submit([7, 7, 7], completion([7, 7, 7], max_tokens=60, temperature=1.0, n=2), doomed)
        loop.submit([1, 2, 3, 4], completion([1, 2, 3, 4], max_tokens=30, temperature=0), subs[0])
        loop.submit([5, 6, 7], completion([5, 6, 7], max_tokens=30, temperature=0), subs[1])
        loop.submit([9, 9], completion([9, 9], max_tokens=20, temperature=1.0, seed=1, n=3), subs[2])
        got = 0
        while got < 3:
            got += isinstance(await asyncio.wait_for(doomed.events.get(), TIMEOUT), Delta)
        loop.abort(doomed_id)
        return [await events_until_end(s) for s in subs]

    ends = run_async(main, loop)
    assert [e[-1] for e in ends] == [Finished(4, 30), Finished(3, 30), Finished(2, 60)]
    stats = loop.engine.stats
    assert stats.preemptions > 0, "the pool was not small enough to preempt"
    assert metric(loop, "paged_preemptions_total") == stats.preemptions
    assert metric(loop, "paged_requests_finished_total", reason="length") == 5
    assert metric(loop, "paged_requests_finished_total", reason="abort") == 2
    assert metric(loop, "paged_requests_finished_total", reason="stop") == 0
    emitted = [len(s.output_ids) for s in created]
    assert all(s.status is Status.FINISHED for s in created[:2]) and 3 <= sum(emitted[:2]) and max(emitted[:2]) < 60
    assert metric(loop, "paged_time_to_first_token_seconds_count") == sum(1 for n in emitted if n)
    assert metric(loop, "paged_inter_token_seconds_count") == sum(n - 1 for n in emitted if n)
    assert metric(loop, "paged_prefix_cache_hit_rate") == stats.cached_tokens / stats.prompt_tokens
    assert metric(loop, "paged_requests_running") == 0 == metric(loop, "paged_requests_waiting")
    assert metric(loop, "paged_blocks_held") == 1  # the CUDA-graph dummy block only


# --- SIGTERM past the grace period -------------------------------------------------------------------------


def test_sigterm_answers_requests_open_past_the_grace_period_with_503():
    """--shutdown-timeout 1, one stream and one whole request of 4,000 tokens (ignore_eos) running: SIGTERM.
    After the grace period the stream ends with an error event (503, the server is shutting down) then
    [DONE]; the whole request gets a 503 JSON error saying the same; the process exits 0. (Before the fix
    uvicorn cancelled both handlers first: a 500, and a stream cut with no error.)"""
    with ServerProcess(["--shutdown-timeout", "1"]) as server:
        body = {"model": server.model, "prompt": [1, 2, 3, 4], "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True}

        async def run():
            timeout = httpx.Timeout(TIMEOUT * 3)
            async with httpx.AsyncClient(timeout=timeout) as a, httpx.AsyncClient(timeout=timeout) as b:
                whole = asyncio.create_task(b.post(server.url + "/completions", json=body))
                lines, stopping = [], None
                async with a.stream("POST", server.url + "/completions", json={**body, "stream": True}) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line:
                            lines.append(line)
                        if len(lines) == 5 and stopping is None:  # both are running (the whole one was sent first)
                            stopping = asyncio.create_task(asyncio.to_thread(server.stop, 30))
                return lines, await whole, await stopping

        lines, whole, status = asyncio.run(asyncio.wait_for(run(), 90))
    assert status == 0, server.stderr_tail()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["message"] == "the server is shutting down", error
    assert 5 <= len(lines) < 4000
    assert whole.status_code == 503, whole.text
    assert whole.json()["error"]["message"] == "the server is shutting down"


def test_a_caller_stopped_by_sigterm_leaves_no_server_behind(tmp_path):
    """A benchmark killed with `kill` stops its server (started in a session of its own) on the way out."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    caller = tmp_path / "caller.py"
    caller.write_text("import sys, time\nsys.path.insert(0, sys.argv[1])\nfrom shared.server_process import ServerProcess\n"
                      "server = ServerProcess([]).start()\nprint(server.proc.pid, flush=True)\ntime.sleep(600)\n")
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, str(caller), root], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(server_pid, signal.SIGKILL)
        pytest.fail("the server outlived its caller's SIGTERM")
    finally:
        proc.kill()

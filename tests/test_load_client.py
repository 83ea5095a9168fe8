"""scripts/load.py, the load client: its seeded workload, its arithmetic, its option errors, and one run against
a fake streaming server started in-process (no model anywhere; a few seconds in all)."""
from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request  # at module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import JSONResponse, StreamingResponse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import load  # noqa: E402
from load import LoadError, LoadSpec, RequestRecord  # noqa: E402


# ----- the workload -----

def test_same_seed_same_workload_other_seed_other_workload():
    spec = LoadSpec(num_requests=20, request_rate=5.0, seed=7)
    first, again = load.make_workload(spec), load.make_workload(spec)
    assert first == again
    other = load.make_workload(replace(spec, seed=8))
    assert [j.prompt for j in other] != [j.prompt for j in first]
    assert [(j.input_words, j.max_tokens) for j in other] != [(j.input_words, j.max_tokens) for j in first]
    assert [j.arrival_s for j in other] != [j.arrival_s for j in first]


def test_lengths_stay_in_their_ranges_and_prompts_have_that_many_words():
    jobs = load.make_workload(LoadSpec(num_requests=200, input_len=(3, 9), output_len=(4, 6), seed=1))
    assert {j.input_words for j in jobs} == set(range(3, 10))  # 200 draws cover all 7 values
    assert {j.max_tokens for j in jobs} == {4, 5, 6}
    assert all(len(j.prompt.split()) == j.input_words for j in jobs)
    assert all(w in load.WORDS for j in jobs for w in j.prompt.split())


def test_pacing_never_changes_prompts_or_lengths():
    spec = LoadSpec(num_requests=10, seed=3)
    paced = [replace(spec, request_rate=2.0), replace(spec, request_rate=2.0, arrivals="fixed")]
    strip = lambda jobs: [(j.prompt, j.max_tokens) for j in jobs]  # noqa: E731
    for other in paced:
        assert strip(load.make_workload(other)) == strip(load.make_workload(spec))


def test_unlimited_rate_releases_everything_at_once():
    assert [j.arrival_s for j in load.make_workload(LoadSpec(num_requests=5))] == [0.0] * 5


def test_fixed_arrivals_are_evenly_spaced():
    times = load.arrival_offsets(50, 4.0, "fixed", random.Random(0))
    assert times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps == pytest.approx([0.25] * 49, abs=1e-12)


def test_poisson_gaps_average_one_over_the_rate():
    rate, n = 4.0, 20_000
    times = load.arrival_offsets(n + 1, rate, "poisson", random.Random(11))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = sum(gaps) / n
    # The mean of 20,000 exponential gaps has a standard deviation of 0.7% of 1/rate: 5% is seven of them.
    assert mean == pytest.approx(1 / rate, rel=0.05)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / n)
    assert std == pytest.approx(1 / rate, rel=0.05)  # exponential: the spread equals the mean; fixed would be 0


def test_parse_range():
    assert load.parse_range("32-256", "input-len") == (32, 256)
    assert load.parse_range("8", "output-len") == (8, 8)
    for bad in ("a-b", "1-2-3", ""):
        with pytest.raises(LoadError, match="MIN-MAX"):
            load.parse_range(bad, "input-len")


@pytest.mark.parametrize("change, message", [
    ({"concurrency": 0}, "--concurrency"), ({"num_requests": 0}, "--num-requests"),
    ({"request_rate": 0.0}, "--request-rate"), ({"request_rate": math.nan}, "--request-rate"),
    ({"input_len": (9, 3)}, "--input-len"), ({"output_len": (0, 3)}, "--output-len"),
    ({"endpoint": "embeddings"}, "--endpoint"), ({"timeout": 0.0}, "--timeout"),
])
def test_spec_check_names_the_option(change, message):
    with pytest.raises(LoadError, match=message):
        replace(LoadSpec(), **change).check()


def test_extra_body_spells_ignore_eos_per_server():
    assert load.extra_body(LoadSpec()) is None
    assert load.extra_body(LoadSpec(ignore_eos=True)) == {"ignore_eos": True}
    body = load.extra_body(LoadSpec(ignore_eos=True, ignore_eos_field="generation_config"))
    assert set(body) == {"generation_config"}
    assert json.loads(body["generation_config"])["eos_token_id"] == -1
    assert load.extra_body(LoadSpec(ignore_eos=True, ignore_eos_field="min_tokens"), 37) == {"min_tokens": 37, "repeat_penalty": 1.0}


# ----- the numbers -----

def test_stats_interpolate_between_ranks():
    ms = load.stats_ms([0.004, 0.001, 0.003, 0.002])  # sorted: 1 2 3 4 ms
    assert ms == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})  # ranks 1.5, 2.7, 2.97
    assert load.stats_ms([0.005])["p99"] == pytest.approx(5.0)
    assert load.stats_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def records() -> list[RequestRecord]:
    """Two completed requests and one failed, timed by hand."""
    a = RequestRecord(0, input_words=8, max_tokens=5, arrival_s=0.0, ok=True, ttft_s=0.1, e2el_s=0.5,
                      chunk_s=[0.1, 0.2, 0.3, 0.5], prompt_tokens=10, output_tokens=5, token_source="usage")
    b = RequestRecord(1, input_words=18, max_tokens=3, arrival_s=0.0, ok=True, ttft_s=0.3, e2el_s=0.9,
                      chunk_s=[0.3, 0.6, 0.9], prompt_tokens=None, output_tokens=3, token_source="chunks")
    c = RequestRecord(2, input_words=4, max_tokens=4, arrival_s=0.0, ok=False, error="HTTP 500: boom")
    return [a, b, c]


def test_record_tpot_and_itl():
    a, b, _ = records()
    assert a.tpot_s == pytest.approx(0.1)  # (0.5 - 0.1) / (5 - 1)
    assert b.tpot_s == pytest.approx(0.3)  # (0.9 - 0.3) / (3 - 1)
    assert a.itl_s == pytest.approx([0.1, 0.1, 0.2])
    one = RequestRecord(3, 1, 1, 0.0, ok=True, ttft_s=0.2, e2el_s=0.2, chunk_s=[0.2], output_tokens=1)
    assert one.tpot_s is None and one.itl_s == []


def test_summary_of_hand_made_records():
    s = load.summarize(records(), duration_s=2.0)
    assert (s["completed"], s["failed"], s["first_error"]) == (2, 1, "HTTP 500: boom")
    assert s["output_tokens"] == 8
    assert s["prompt_tokens"] == 28  # 10 counted by the server + 18 words sent (b had no usage)
    assert s["prompt_tokens_source"] == "usage+words" and s["output_tokens_source"] == "chunks+usage"
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(18.0)
    assert s["ttft_ms"] == pytest.approx({"mean": 200, "p50": 200, "p90": 280, "p99": 298})
    assert s["tpot_ms"] == pytest.approx({"mean": 200, "p50": 200, "p90": 280, "p99": 298})
    # gaps 100, 100, 200 (a) and 300, 300 (b): sorted 100 100 200 300 300
    assert s["itl_ms"] == pytest.approx({"mean": 200, "p50": 200, "p90": 300, "p99": 300})
    assert s["e2el_ms"] == pytest.approx({"mean": 700, "p50": 700, "p90": 860, "p99": 896})
    assert s["short_outputs"] == 0
    assert "goodput" not in s


@pytest.mark.parametrize("ttft_ms, tpot_ms, good", [
    (200, None, 1),  # a's TTFT 100 ms passes, b's 300 ms does not
    (400, None, 2),
    (None, 200, 1),  # a's TPOT 100 ms passes, b's 300 ms does not
    (400, 200, 1),  # both bounds: only a
    (50, 400, 0),
    (1e9, 1e9, 2),  # the failed request never counts
])
def test_goodput_counts_requests_within_every_bound(ttft_ms, tpot_ms, good):
    s = load.summarize(records(), duration_s=2.0, goodput_ttft_ms=ttft_ms, goodput_tpot_ms=tpot_ms)
    assert s["good_requests"] == good
    assert s["goodput"] == pytest.approx(good / 2.0)


def test_a_single_token_request_passes_any_tpot_bound():
    one = RequestRecord(0, 1, 1, 0.0, ok=True, ttft_s=0.05, e2el_s=0.05, chunk_s=[0.05], output_tokens=1)
    assert load.meets(one, ttft_ms=100, tpot_ms=1)
    assert not load.meets(one, ttft_ms=10, tpot_ms=None)


# ----- the command line -----

def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """load.py's main() in this process (a subprocess would spend seconds importing torch): status, out, err."""
    monkeypatch.setattr(sys, "argv", ["load.py", *args])
    with pytest.raises(SystemExit) as exit_:
        load.main()
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def test_bad_option_exits_2_with_one_line_as_a_script():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "load.py"), "--concurrency", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: --concurrency must be at least 1, got 0"]
    assert out.stdout == ""


@pytest.mark.parametrize("args, message", [
    (("--input-len", "9-3"), "error: --input-len needs 1 <= MIN <= MAX, got 9-3"),
    (("--output-len", "x"), "error: --output-len 'x': use MIN-MAX or N"),
    (("--request-rate", "-1"), "error: --request-rate must be positive"),
    (("--goodput-tpot-ms", "0"), "error: --goodput-tpot-ms must be positive"),
    (("--endpoint", "embeddings"), "error: argument --endpoint: invalid choice"),
])
def test_bad_options_exit_2_with_one_line(monkeypatch, capsys, args, message):
    status, out, err = run_main(monkeypatch, capsys, *args)
    assert status == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message)


def test_no_server_and_no_model_asks_for_model(monkeypatch, capsys):
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        status, _, err = run_main(monkeypatch, capsys, "--url", f"http://127.0.0.1:{s.getsockname()[1]}/v1")
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not list the models") and "--model" in lines[0]


# ----- against a fake server -----

class FakeServer:
    """An OpenAI-style streaming server with no model: one chunk per token ("t0 ", "t1 ", ...), a role-only chunk
    first, usage in a last chunk with no choices. Model "no-usage" leaves usage out; model "fail" answers 500."""

    CHUNK_DELAY_S = 0.003

    def __init__(self):
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        async def handle(request: Request, chat: bool):
            body = await request.json()
            self.bodies.append(body)
            if body["model"] == "fail":
                return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
            return StreamingResponse(self.stream(body, chat), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, False)

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    async def stream(self, body: dict, chat: bool):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            n = body["max_tokens"]
            kind = "chat.completion.chunk" if chat else "text_completion"

            def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
                if chat:
                    delta = {"role": "assistant", "content": ""} if role else {"content": text}
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": finish}
                return "data: " + json.dumps({"id": "x", "object": kind, "created": 0, "model": body["model"],
                                              "choices": [choice]}) + "\n\n"

            if chat:
                yield chunk(None, role=True)
            for i in range(n):
                await asyncio.sleep(self.CHUNK_DELAY_S)
                yield chunk(f"t{i} ", "length" if i == n - 1 else None)
            if body["model"] != "no-usage" and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                         "total_tokens": len(prompt.split()) + n}
                yield "data: " + json.dumps({"id": "x", "object": kind, "created": 0, "model": body["model"],
                                             "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake():
    with FakeServer() as server:
        yield server


SPEC = LoadSpec(num_requests=6, concurrency=2, input_len=(3, 12), output_len=(2, 7), seed=5, ignore_eos=True)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_run_load_counts_tokens_and_chunks(fake, endpoint):
    spec = replace(SPEC, endpoint=endpoint)
    fake.bodies.clear()
    fake.max_in_flight = 0
    result = asyncio.run(load.run_load(spec, fake.url, "fake-model"))
    jobs = load.make_workload(spec)
    assert fake.max_in_flight == 2  # six requests released at once, two slots
    assert len(fake.bodies) == 6
    for body in fake.bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0
    for job, r in zip(jobs, result.records):
        assert r.ok and r.error is None
        assert r.output_tokens == job.max_tokens and r.token_source == "usage"
        assert r.prompt_tokens == job.input_words  # the fake counts words
        assert len(r.chunk_s) == job.max_tokens  # the role-only chunk is not a token
        assert r.text == "".join(f"t{i} " for i in range(job.max_tokens))
        assert r.finish_reason == "length"
        assert 0 < r.ttft_s <= r.e2el_s < 10
        assert len(r.itl_s) == job.max_tokens - 1 and all(g >= 0 for g in r.itl_s)
    s = load.summarize(result.records, result.duration_s)
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["output_tokens"] == sum(j.max_tokens for j in jobs)
    assert s["prompt_tokens"] == sum(j.input_words for j in jobs) and s["prompt_tokens_source"] == "usage"
    assert s["output_tokens_source"] == "usage" and s["short_outputs"] == 0


def test_without_usage_the_chunks_are_counted(fake):
    result = asyncio.run(load.run_load(SPEC, fake.url, "no-usage"))
    for job, r in zip(load.make_workload(SPEC), result.records):
        assert r.ok and r.token_source == "chunks" and r.output_tokens == job.max_tokens
        assert r.prompt_tokens is None
    assert load.summarize(result.records, result.duration_s)["prompt_tokens_source"] == "words"


def test_failed_requests_are_recorded_not_raised(fake):
    result = asyncio.run(load.run_load(replace(SPEC, num_requests=3), fake.url, "fail"))
    assert [r.ok for r in result.records] == [False] * 3
    assert all(r.error == "HTTP 500: boom" for r in result.records)
    s = load.summarize(result.records, result.duration_s)
    assert (s["completed"], s["failed"], s["first_error"]) == (0, 3, "HTTP 500: boom")
    assert s["ttft_ms"]["p50"] is None


def test_model_discovery_takes_the_first_listed(fake):
    assert asyncio.run(load.discover_model(fake.url)) == "fake-model"


def test_cli_end_to_end_writes_json(fake, tmp_path, monkeypatch, capsys):
    path = tmp_path / "load.json"
    status, out, err = run_main(monkeypatch, capsys, "--url", fake.url, "--num-requests", "4", "--concurrency", "2",
                                "--output-len", "3", "--input-len", "5", "--goodput-ttft-ms", "60000",
                                "--json", str(path))
    assert status == 0, err
    assert "completed / failed" in out and "TTFT" in out
    report = json.loads(path.read_text())
    assert report["model"] == "fake-model" and report["spec"]["request_rate"] is None
    assert report["summary"]["completed"] == 4 and report["summary"]["output_tokens"] == 12
    assert report["summary"]["good_requests"] == 4
    assert [r["output_tokens"] for r in report["requests"]] == [3] * 4
    assert all(len(r["itl_s"]) == 2 for r in report["requests"])


def test_cli_exits_1_when_a_request_fails(fake, monkeypatch, capsys):
    status, out, _ = run_main(monkeypatch, capsys, "--url", fake.url, "--model", "fail", "--num-requests", "2")
    assert status == 1
    assert "2 request(s) failed" in out and "HTTP 500: boom" in out

"""L15's three processes, as a user starts them: scripts/serve.py --kv-role kv_producer (P) and kv_consumer (D) and
scripts/l15_proxy.py in front of them, beside a colocated scripts/serve.py, all with --batch-invariant (so D's
tokens must be the colocated server's exactly, seeded samples included), on loopback, the embedded tiny model.

- The official `openai` client through the proxy, streamed and whole, completions and chat (max_tokens and
  max_completion_tokens), n = 2 seeded, a structured-output choice: the colocated server's tokens and text, its usage;
  P's pool back to its dummy block once D released the lease.
- A client that leaves mid-stream: the proxy closes D's stream, D aborts the request; both pools free again.
- Pages that cannot be pulled: a lease that expired (P freed it while idle, seen in its /metrics) and a P killed
  before D pulls: D recomputes (the colocated tokens); with --kv-load-failure-policy fail, a 502 that says why.
- Refusals through the real servers: a malformed kv_transfer_params is a 400 at P, at D and at the proxy.
- Flags that cannot mean anything (not slow: serve.py's and the proxy's checks, in process); the one line and exit 2
  a user sees for a role with --tp 2 and for a proxy given a URL that is not one.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from shared.errors import CourseError
from shared.server_process import SERVE, ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
PROXY = ROOT / "scripts" / "l15_proxy.py"
TIMEOUT = 60.0
BASE_HELD = 1  # a fresh pool's dummy block (L7)
SERVERS = {
    "colocated": ["--batch-invariant"],
    "p": ["--batch-invariant", "--kv-role", "kv_producer"],
    "d": ["--batch-invariant", "--kv-role", "kv_consumer"],
    "p_short": ["--batch-invariant", "--kv-role", "kv_producer", "--kv-lease-s", "1"],
    "d_strict": ["--batch-invariant", "--kv-role", "kv_consumer", "--kv-load-failure-policy", "fail"],
}
PROMPT = ("A disaggregated server prefills on one engine and decodes on another; the decode engine pulls the "
          "prompt's pages and continues exactly where the prefill engine stopped.")


def start_proxy(prefill: ServerProcess, decode: ServerProcess) -> ServerProcess:
    port = free_port()
    return ServerProcess(cmd=[sys.executable, str(PROXY), "--prefill", prefill.url, "--decode", decode.url,
                              "--port", str(port)],
                         url=f"http://127.0.0.1:{port}/v1", model=decode.model, label="l15_proxy.py").start()


@pytest.fixture(scope="module")
def live():
    """Every server started at once (each loads the model: seconds), then the proxy in front of P and D. At the end
    each still running is stopped with SIGTERM and must exit 0 (the test that kills P kills p_short)."""
    with ThreadPoolExecutor(len(SERVERS)) as pool:
        futures = {name: pool.submit(ServerProcess(args).start) for name, args in SERVERS.items()}
        started, failures = {}, []
        for name, future in futures.items():
            try:
                started[name] = future.result(timeout=300)
            except Exception as e:
                failures.append(f"{name}: {e}")
    try:
        assert not failures, failures
        started["proxy"] = start_proxy(started["p"], started["d"])
        yield started
    finally:
        statuses = {name: s.stop(timeout=30) if s.alive() else "killed" for name, s in started.items()}
    assert all(status in (0, "killed") for status in statuses.values()), statuses


def root(server: ServerProcess) -> str:
    return server.url.removesuffix("/v1")


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(root(server) + "/metrics", timeout=TIMEOUT).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(paged_\S+) (\S+)$", text, re.M)}


def wait_for(server: ServerProcess, condition, what: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if condition(m):
            return m
        assert time.monotonic() < deadline, (f"{what}: not within {timeout:.0f} s; "
                                             f"{ {k: v for k, v in m.items() if 'bucket' not in k} }")
        time.sleep(0.05)


def idle(server: ServerProcess, what: str) -> dict[str, float]:
    return wait_for(server, lambda m: m["paged_blocks_held"] == BASE_HELD and m["paged_requests_running"] == 0
                    and m["paged_requests_waiting"] == 0, what)


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT)


def stream_completion(server: ServerProcess, **kwargs) -> tuple[dict[int, list[int]], dict[int, str], dict]:
    """(token ids and text of each choice, the usage) of one streamed completion, with the openai client."""
    ids: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    usage = None
    with client(server) as c:
        for chunk in c.completions.create(model=server.model, stream=True, stream_options={"include_usage": True},
                                          extra_body={"return_token_ids": True, "ignore_eos": True}, **kwargs):
            for choice in chunk.choices:
                ids.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
                texts[choice.index] = texts.get(choice.index, "") + choice.text
            usage = chunk.usage or usage
    return ids, texts, usage.model_dump()


def body(server: ServerProcess, prompt: str = PROMPT, **extra) -> dict:
    return {"model": server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def lease(p: ServerProcess, prompt: str) -> dict:
    r = httpx.post(p.url + "/completions", json=body(p, prompt, max_tokens=1,
                                                     kv_transfer_params={"do_remote_decode": True}), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def token_ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.slow
def test_the_openai_client_through_the_proxy_gets_the_colocated_servers_tokens(live):
    proxy, colocated, p, d = live["proxy"], live["colocated"], live["p"], live["d"]
    for kwargs in ({"prompt": PROMPT, "max_tokens": 12, "temperature": 0},
                   {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8, "seed": 5, "n": 2}):
        got, want = stream_completion(proxy, **kwargs), stream_completion(colocated, **kwargs)
        assert got == want, kwargs
    with client(proxy) as via, client(colocated) as alone:
        messages = [{"role": "user", "content": "Say something about pages."}]
        whole = [c.chat.completions.create(model=proxy.model, messages=messages, max_tokens=10, temperature=0)
                 for c in (via, alone)]
        assert whole[0].choices[0].message.content == whole[1].choices[0].message.content
        assert whole[0].usage == whole[1].usage  # D's usage: the whole prompt, as colocated
        assert whole[0].id != whole[1].id and whole[0].id.startswith("chatcmpl-")
        streamed = ["".join(chunk.choices[0].delta.content or "" for chunk in c.chat.completions.create(
            model=proxy.model, messages=messages, max_completion_tokens=10, temperature=0, stream=True)
            if chunk.choices) for c in (via, alone)]  # the proxy asks P for max_completion_tokens 1 then
        assert streamed[0] == streamed[1] == whole[1].choices[0].message.content
        choice = [c.completions.create(model=proxy.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["pages", "blocks", "tokens"]}})
                  for c in (via, alone)]  # L13's hook beside L15's: P and D compile the grammar too
        assert choice[0].choices[0].text == choice[1].choices[0].text in ("pages", "blocks", "tokens")
        assert [m.id for m in via.models.list().data] == [proxy.model]
    assert metrics(d)['paged_kv_pulls_total{result="pulled"}'] >= 5
    idle(p, "P frees every lease D released")
    wait_for(p, lambda m: m["paged_kv_leases"] == 0, "P's leases all ended (a short prompt's holds no block)")
    idle(d, "D holds nothing after its requests")


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_frees_both_pools(live):
    proxy, p, d = live["proxy"], live["p"], live["d"]
    aborted = metrics(d).get('paged_requests_finished_total{reason="abort"}', 0)
    with httpx.stream("POST", proxy.url + "/completions", json=body(proxy, max_tokens=2000, stream=True),
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving: the connection closes
    wait_for(d, lambda m: m.get('paged_requests_finished_total{reason="abort"}', 0) == aborted + 1,
             "D aborted the request")
    idle(d, "D frees the request's blocks")
    idle(p, "P freed the lease D released")


@pytest.mark.slow
def test_pages_that_cannot_be_pulled_are_recomputed_or_refused_with_a_502(live):
    colocated, p_short, d, strict = live["colocated"], live["p_short"], live["d"], live["d_strict"]
    # new to D: its own prefix cache cannot stand in for the pages
    prompts = [f"Request {i}: pages that never arrive are computed again, from the first token to the last one."
               for i in range(2)]
    want = [token_ids(httpx.post(colocated.url + "/completions", json=body(colocated, x), timeout=TIMEOUT))
            for x in prompts]
    expired = lease(p_short, prompts[0])
    assert expired["remote_block_ids"] and metrics(p_short)["paged_kv_leases"] == 1  # set before the answer left
    started = time.monotonic()
    idle(p_short, "P frees a lease nobody pulled, with no request running")
    assert time.monotonic() - started < 5
    recomputed = metrics(d)['paged_kv_pulls_total{result="recomputed"}']
    assert token_ids(httpx.post(d.url + "/completions", json=body(d, prompts[0], kv_transfer_params=expired),
                                timeout=TIMEOUT)) == want[0]
    assert metrics(d)['paged_kv_pulls_total{result="recomputed"}'] == recomputed + 1

    orphaned = lease(p_short, prompts[1])
    p_short.kill()  # before D pulls
    r = httpx.post(strict.url + "/completions", json=body(strict, prompts[1], kv_transfer_params=orphaned),
                   timeout=TIMEOUT)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "kv_transfer_failed" and error["type"] == "server_error"
    assert f"127.0.0.1:{orphaned['remote_port']} failed" in error["message"], error
    assert token_ids(httpx.post(d.url + "/completions", json=body(d, prompts[1], kv_transfer_params=orphaned),
                                timeout=TIMEOUT)) == want[1]
    assert metrics(d)['paged_kv_pulls_total{result="recomputed"}'] == recomputed + 2
    assert "its prompt is recomputed" in d.log_text()
    idle(d, "D after the recomputed requests")
    idle(strict, "D (policy fail) took nothing")


@pytest.mark.slow
def test_malformed_kv_transfer_params_are_400s_at_every_server(live):
    proxy, p, d = live["proxy"], live["p"], live["d"]
    for server, params, param in ((d, [1], "kv_transfer_params"),
                                  (d, {"do_remote_prefill": True}, "kv_transfer_params"),
                                  (p, {"do_remote_decode": "true"}, "kv_transfer_params.do_remote_decode"),
                                  (proxy, {"do_remote_decode": True}, "kv_transfer_params")):
        r = httpx.post(server.url + "/completions", json=body(d, kv_transfer_params=params), timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(p.url + "/completions", json=body(p, stream=True, kv_transfer_params={"do_remote_decode": True}),
                   timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    idle(d, "D took nothing")


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kv_flags_that_cannot_mean_anything_are_refused_before_the_model_loads():
    serve, proxy = load_script(SERVE), load_script(PROXY)
    refused = {("--kv-role", "kv_producer", "--tp", "2"): "--kv-role kv_producer runs at --tp 1, not 2: pages move "
                                                          "between two single-rank engines here",
               ("--kv-port", "9000"): "--kv-port is a kv_producer server's: it needs --kv-role kv_producer",
               ("--kv-role", "kv_consumer", "--kv-lease-s", "5"): "--kv-lease-s is a kv_producer server's: it needs "
                                                                  "--kv-role kv_producer",
               ("--kv-role", "kv_producer", "--kv-load-failure-policy", "fail"): "--kv-load-failure-policy is a "
                                                                                 "kv_consumer server's: it needs "
                                                                                 "--kv-role kv_consumer",
               ("--kv-role", "kv_producer", "--kv-port", "70000"): "--kv-port must be in [0, 65535], got 70000",
               ("--kv-role", "kv_producer", "--kv-lease-s", "nan"): "--kv-lease-s must be a positive number of "
                                                                    "seconds, got nan"}
    for argv, message in refused.items():
        with pytest.raises(CourseError) as e:
            serve.check_kv_role(serve.parser().parse_args(list(argv)))
        assert str(e.value) == message
    assert serve.check_kv_role(serve.parser().parse_args([])) == {}
    assert serve.check_kv_role(serve.parser().parse_args(["--kv-role", "kv_producer", "--kv-lease-s", "2"])) == \
        {"host": "127.0.0.1", "port": 0, "lease_s": 2.0}
    assert serve.check_kv_role(serve.parser().parse_args(["--kv-role", "kv_consumer"])) == {"policy": "recompute"}
    for url in ("127.0.0.1:8100", "ftp://x", "http://127.0.0.1:99999"):
        with pytest.raises(CourseError):
            proxy.check_url(url, "--prefill")
    assert proxy.check_url("http://127.0.0.1:8100/v1", "--prefill") == "http://127.0.0.1:8100/v1"


@pytest.mark.slow  # two interpreters start (torch's import each): the one line and exit 2 as a user sees them
def test_a_role_with_tensor_parallel_ranks_or_a_proxy_without_urls_is_refused_in_one_line():
    r = subprocess.run([sys.executable, str(SERVE), "--kv-role", "kv_consumer", "--tp", "2", "--port", "0"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert (r.returncode, r.stderr.strip()) == (2, "error: --kv-role kv_consumer runs at --tp 1, not 2: pages move "
                                                   "between two single-rank engines here")
    r = subprocess.run([sys.executable, str(PROXY), "--prefill", "127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert (r.returncode, r.stderr.strip()) == (2, "error: --prefill '127.0.0.1:8100': give the server's URL, e.g. "
                                                   "http://127.0.0.1:8100")

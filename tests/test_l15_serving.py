"""L15's servers in process: P's and D's apps (lessons/l15_disaggregated/server.py on L9's app and engine thread)
and the proxy's, joined by httpx's ASGI transport (the pages still move over loopback sockets), on the tiny model
with L14's batch-invariant mode, so a request through P and D must give a colocated server's tokens exactly, seeded
samples included. Between D and P's page server a Gate can hold a pull in flight (or cut it), which makes the timing
cases deterministic. After each case both pools are checked: every block free or cached, none held but the dummy.

- Through the proxy (whole and streamed, n = 2 seeded too): a colocated server's tokens; usage counts the whole
  prompt; D pulled the prompt's full blocks and P freed its lease once D released it. A plain request on P leases
  nothing; vLLM's proxy's shape of the lease request (the other fields null) is accepted.
- Every malformed kv_transfer_params, on P, on D and at the proxy, and a request D's pool could never hold: a 400
  naming the field, nothing taken.
- D without room for a pull (another pull holds its blocks): 503 with Retry-After, nothing taken (through the
  proxy too, Retry-After passed on); the held pull then lands and its request gives the colocated tokens.
- A pull that fails: recompute gives the colocated tokens; policy fail is a 502 (kv_transfer_failed).
- A lease nobody pulls: P frees it while idle, within a couple of seconds; D then recomputes.
- A client that leaves while its pages are in flight: its blocks stay held until the pull returns (it writes into
  them), then are freed, nothing runs, and P's lease is released.
- The proxy with P or D unreachable: a 502 in OpenAI's shape; /health 503.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI

from lessons.l9_server.app import ServedModel, create_app
from lessons.l9_server.detokenizer import TokenBytes
from lessons.l9_server.engine_loop import EngineLoop
from lessons.l9_server.metrics import ServerMetrics
from lessons.l15_disaggregated import L15Engine
from lessons.l15_disaggregated.proxy import create_proxy
from lessons.l15_disaggregated.server import KvEngineLoop, create_kv_app
from shared.config import Qwen3Config
from shared.server_process import free_port
from test_l3_cpp_backend import needs_kernel
from test_l9_streams import Client

pytestmark = needs_kernel  # L14's mode attends with the C++ kernel
TIMEOUT = 30.0  # every wait: a bug fails the test, it never hangs it
MODEL = "tiny"
BLOCK = 16
BASE_HELD = 1  # a fresh pool holds one block: the CUDA-graph dummy (L7, one past num_blocks), on the CPU too


@dataclass
class Served:
    engine: L15Engine
    loop: EngineLoop
    app: FastAPI

    @property
    def held(self) -> int:
        return self.engine.allocator.num_blocks - self.engine.allocator.num_free

    def metric(self, name: str, default: float | None = None) -> float:
        """A line of /metrics (a labelled counter never counted has none: `default`)."""
        for line in self.loop.metrics.render().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        if default is None:
            raise KeyError(name)
        return default


@pytest.fixture(scope="module")
def setup(tiny_model, tokenizer, tiny_dir):
    config = Qwen3Config.from_dir(tiny_dir)
    return tiny_model, tokenizer, config


def serve(setup, role: str, num_blocks: int = 64, **connector) -> Served:
    model, tokenizer, config = setup
    engine = L15Engine(model, BLOCK, num_blocks, kv_role=role, batch_invariant=True, connector_args=connector or None)
    loop_class, make_app = (EngineLoop, create_app) if role == "kv_both" else (KvEngineLoop, create_kv_app)
    loop = loop_class(engine, TokenBytes(tokenizer), ServerMetrics(), frozenset(config.eos_token_ids), 64)
    app = make_app(ServedModel(MODEL, tokenizer, None, config.max_position_embeddings, config.vocab_size), loop)
    return Served(engine, loop, app)


@asynccontextmanager
async def running(*servers: Served):
    """Their engine threads started, a client for each app; afterwards every loop stopped, every page server closed."""
    for s in servers:
        s.loop.start()
    clients = [httpx.AsyncClient(transport=httpx.ASGITransport(s.app), base_url="http://test", timeout=TIMEOUT)
               for s in servers]
    try:
        yield clients
    finally:
        for c in clients:
            await c.aclose()
        for s in servers:
            await asyncio.to_thread(s.loop.stop, TIMEOUT)
            s.engine.close()


def proxy_for(p: Served, d: Served, **options) -> httpx.AsyncClient:
    mounts = {"http://prefill": httpx.ASGITransport(p.app), "http://decode": httpx.ASGITransport(d.app)}
    app = create_proxy("http://prefill", "http://decode/v1", mounts=mounts, **options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy", timeout=TIMEOUT)


async def until(condition, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        await asyncio.sleep(0.02)


async def idle(*servers: Served) -> None:
    """Each pool back to its dummy block (P: once its engine thread reaped), nothing running or waiting."""
    for s in servers:
        await until(lambda s=s: s.held == BASE_HELD and not s.loop.jobs and not s.engine.scheduler.has_work(),
                    f"{s.engine.kv_role}'s pool idle again")


def ids(n: int, start: int) -> list[int]:
    return list(range(start, start + n))  # ordinary BPE tokens: any run is a valid prompt


def body(prompt: list[int], max_tokens: int = 6, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def tokens(response: httpx.Response) -> list[list[int]]:
    assert response.status_code == 200, response.text
    return [c["token_ids"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def streamed(response: httpx.Response) -> list[list[int]]:
    """The token ids of each choice in an SSE body (httpx's ASGI transport hands the whole stream over at once)."""
    assert response.status_code == 200, response.text
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events[-1]
    out: dict[int, list[int]] = {}
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            out.setdefault(choice["index"], []).extend(choice["token_ids"])
    return [out[i] for i in sorted(out)]


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["message"] and error["type"], error
    return error


async def lease(p_client: httpx.AsyncClient, request: dict) -> dict:
    """P's part as the proxy asks it: one token, the lease in the answer."""
    r = await p_client.post("/v1/completions", json={**request, "max_tokens": 1,
                                                        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


class Gate:
    """A stand-in for P's page server: it accepts D's pull and holds it until opened, then relays it both ways to P's
    real page server (or, with none, hangs up: the pull fails)."""

    def __init__(self, target: tuple[str, int] | None):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted, self.opened = threading.Event(), threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def via(self, params: dict) -> dict:
        return {**params, "remote_port": self.port}

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        self.accepted.set()
        self.opened.wait(TIMEOUT)
        if self.target is None:
            conn.close()
            return
        upstream = socket.create_connection(self.target, TIMEOUT)
        pipes = [threading.Thread(target=pipe, args=pair, daemon=True) for pair in ((conn, upstream), (upstream, conn))]
        for t in pipes:
            t.start()
        for t in pipes:
            t.join(TIMEOUT)
        conn.close()
        upstream.close()

    def close(self) -> None:
        self.opened.set()
        self.listener.close()


def pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 4 * TIMEOUT))


@pytest.mark.task("L15.8")
def test_through_the_proxy_a_request_gets_a_colocated_servers_tokens_and_p_frees_its_lease(setup):
    colocated, p, d = serve(setup, "kv_both"), serve(setup, "kv_producer"), serve(setup, "kv_consumer")
    prompt = ids(50, 3000)  # three full blocks travel; D recomputes the last two tokens' block

    async def main():
        async with running(colocated, p, d) as (c_client, p_client, d_client):
            proxy = proxy_for(p, d)
            want = tokens(await c_client.post("/v1/completions", json=body(prompt)))
            r = await proxy.post("/v1/completions", json=body(prompt))
            assert tokens(r) == want
            assert r.json()["usage"]["prompt_tokens"] == len(prompt)  # D's usage: the whole prompt
            assert d.metric('paged_kv_pulls_total{result="pulled"}') == 1
            assert d.metric("paged_kv_pulled_blocks_total") == 3
            await idle(p, d)  # D released the lease: P freed it between steps, or once idle
            await until(lambda: p.metric("paged_kv_leases") == 0, "P's lease ended")

            other = ids(40, 7000)
            want = streamed(await c_client.post("/v1/completions", json=body(other, stream=True)))
            assert streamed(await proxy.post("/v1/completions", json=body(other, stream=True))) == want

            seeded = body(ids(37, 9000), 8, temperature=0.8, seed=11, n=2)
            want = tokens(await c_client.post("/v1/completions", json=seeded))
            assert want[0] != want[1]
            assert tokens(await proxy.post("/v1/completions", json=seeded)) == want

            r = await p_client.post("/v1/completions", json=body(prompt, 1))  # a plain request leases nothing
            assert "kv_transfer_params" not in r.json()
            vllm_shaped = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                           "remote_block_ids": None, "remote_host": None, "remote_port": None}
            r = await p_client.post("/v1/completions", json=body(prompt, 1, kv_transfer_params=vllm_shaped))
            params = r.json()["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and len(params["remote_block_ids"]) == 3
            assert tokens(await d_client.post("/v1/completions", json=body(prompt, kv_transfer_params=params))) \
                == tokens(await c_client.post("/v1/completions", json=body(prompt)))
            await idle(p, d)
            await proxy.aclose()

    run(main())


@pytest.mark.task("L15.8")
def test_malformed_kv_transfer_params_are_400s_naming_the_field_and_take_nothing(setup):
    p, d = serve(setup, "kv_producer"), serve(setup, "kv_consumer")
    prompt = ids(40, 5000)

    async def main():
        async with running(p, d) as (p_client, d_client):
            good = await lease(p_client, body(prompt))
            on_d = [([], "kv_transfer_params"), ("x", "kv_transfer_params"),
                    ({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill"),
                    ({"do_remote_prefill": True}, "kv_transfer_params"),
                    ({**good, "remote_block_ids": [1, -2]}, "kv_transfer_params"),
                    ({**good, "remote_block_ids": "1"}, "kv_transfer_params"),
                    ({**good, "remote_port": "80"}, "kv_transfer_params"),
                    ({**good, "remote_request_id": True}, "kv_transfer_params"),
                    ({**good, "remote_host": None}, "kv_transfer_params"),
                    ({**good, "remote_block_ids": [1, 2, 3, 4]}, "kv_transfer_params"),  # the prompt fills 2
                    ({"do_remote_decode": True}, "kv_transfer_params.do_remote_decode"),
                    ({**good, "do_remote_decode": True}, "kv_transfer_params")]
            for params, param in on_d:
                r = await d_client.post("/v1/completions", json=body(prompt, kv_transfer_params=params))
                assert error_of(r, 400)["param"] == param, (params, r.text)
            on_p = [({"do_remote_decode": 1}, body(prompt, 1), "kv_transfer_params.do_remote_decode"),
                    (good, body(prompt, 1), "kv_transfer_params"),  # P's answer is D's to use
                    ({"do_remote_decode": True}, body(prompt, 1, stream=True), "stream")]
            for params, request, param in on_p:
                r = await p_client.post("/v1/completions", json={**request, "kv_transfer_params": params})
                assert error_of(r, 400)["param"] == param, (params, r.text)
            r = await d_client.post("/v1/completions", json=body(prompt, 2000, kv_transfer_params=good))
            assert "the whole pool has 64" in error_of(r, 400)["message"]  # it could never fit: refused before a pull
            proxy = proxy_for(p, d)
            r = await proxy.post("/v1/completions", json=body(prompt, kv_transfer_params={"do_remote_decode": True}))
            assert error_of(r, 400)["param"] == "kv_transfer_params"
            r = await proxy.post("/v1/completions", json=body(prompt, bogus=1))  # P's refusal, passed on
            assert error_of(r, 400)["param"] == "bogus"
            await proxy.aclose()
            assert d.held == BASE_HELD and d.metric('paged_kv_pulls_total{result="pulled"}') == 0
            r = await d_client.post("/v1/completions", json=body(prompt, kv_transfer_params=good))  # still good
            assert r.status_code == 200, r.text
            await idle(p, d)

    run(main())


@pytest.mark.task("L15.8")
def test_d_without_room_for_a_pull_answers_503_with_retry_after_and_takes_nothing(setup):
    colocated, p = serve(setup, "kv_both"), serve(setup, "kv_producer")
    d = serve(setup, "kv_consumer", num_blocks=7)  # the big request fits, with 1 block to spare
    big, small = ids(6 * BLOCK + 1, 11000), ids(2 * BLOCK + 1, 13000)  # 6 and 2 blocks to pull

    async def main():
        async with running(colocated, p, d) as (c_client, p_client, d_client):
            gate = Gate(p.engine.producer.server.address)
            held = asyncio.create_task(d_client.post("/v1/completions", json=body(
                big, 4, kv_transfer_params=gate.via(await lease(p_client, body(big))))))
            await asyncio.to_thread(gate.accepted.wait, TIMEOUT)  # D took 6 blocks; its pull is held
            assert d.held == BASE_HELD + 6
            r = await d_client.post("/v1/completions", json=body(small, 4, kv_transfer_params=await lease(
                p_client, body(small))))
            error = error_of(r, 503)
            assert r.headers["retry-after"] == "1" and error["code"] == "kv_no_room", r.headers
            proxy = proxy_for(p, d)
            r = await proxy.post("/v1/completions", json=body(small, 4, stream=True))  # passed on, Retry-After too
            assert error_of(r, 503)["code"] == "kv_no_room" and r.headers["retry-after"] == "1", r.headers
            await proxy.aclose()
            assert d.held == BASE_HELD + 6  # the refusals took nothing
            gate.opened.set()
            assert tokens(await asyncio.wait_for(held, TIMEOUT)) == \
                tokens(await c_client.post("/v1/completions", json=body(big, 4)))
            gate.close()
            await idle(d)
            await until(lambda: len(p.engine.producer.leases) == 2, "P's first lease released, the refused two kept")

    run(main())


@pytest.mark.task("L15.8")
def test_a_failed_pull_is_recomputed_or_with_policy_fail_a_502(setup):
    colocated, p = serve(setup, "kv_both"), serve(setup, "kv_producer")
    d, strict = serve(setup, "kv_consumer"), serve(setup, "kv_consumer", policy="fail")
    prompt = ids(45, 15000)

    async def main():
        async with running(colocated, p, d, strict) as (c_client, p_client, d_client, strict_client):
            params = await lease(p_client, body(prompt))
            dead = {**params, "remote_port": free_port()}  # P gone: nothing listens there
            r = await strict_client.post("/v1/completions", json=body(prompt, kv_transfer_params=dead))
            error = error_of(r, 502)
            assert error["code"] == "kv_transfer_failed" and "failed" in error["message"], error
            assert strict.metric('paged_kv_pulls_total{result="failed"}') == 1
            cut = Gate(None)  # P hangs up mid-pull
            cut.opened.set()
            r = await d_client.post("/v1/completions", json=body(prompt, kv_transfer_params=cut.via(params)))
            assert tokens(r) == tokens(await c_client.post("/v1/completions", json=body(prompt)))
            assert d.metric('paged_kv_pulls_total{result="recomputed"}') == 1
            cut.close()
            await idle(d, strict)

    run(main())


@pytest.mark.task("L15.8")
def test_a_lease_nobody_pulls_is_freed_while_p_is_idle_and_d_recomputes(setup):
    colocated, p, d = serve(setup, "kv_both"), serve(setup, "kv_producer", lease_s=0.5), serve(setup, "kv_consumer")
    prompt = ids(60, 17000)

    async def main():
        async with running(colocated, p, d) as (c_client, p_client, d_client):
            params = await lease(p_client, body(prompt))
            assert p.held == BASE_HELD + 3 and p.metric("paged_kv_leases") == 1
            started = time.monotonic()
            await idle(p)  # no request runs on P: its idle wait wakes to reap
            assert time.monotonic() - started < 3
            await until(lambda: p.metric("paged_kv_leases") == 0 and p.metric("paged_blocks_held") == BASE_HELD,
                        "P's /metrics say the lease is gone")
            r = await d_client.post("/v1/completions", json=body(prompt, kv_transfer_params=params))
            assert tokens(r) == tokens(await c_client.post("/v1/completions", json=body(prompt)))
            assert d.metric('paged_kv_pulls_total{result="recomputed"}') == 1
            await idle(d)

    run(main())


@pytest.mark.task("L15.8")
def test_a_client_that_leaves_while_its_pages_are_in_flight_takes_nothing_and_p_is_released(setup):
    p, d = serve(setup, "kv_producer"), serve(setup, "kv_consumer")
    prompt = ids(70, 19000)

    async def main():
        async with running(p, d) as (p_client, _):
            gate = Gate(p.engine.producer.server.address)
            params = gate.via(await lease(p_client, body(prompt)))
            client = Client(body(prompt, 50, stream=True, kv_transfer_params=params))
            call = asyncio.create_task(client.call(d.app))
            await asyncio.to_thread(gate.accepted.wait, TIMEOUT)
            client.leave.set()
            await asyncio.wait_for(call, TIMEOUT)
            assert client.sent[0]["status"] == 499
            await asyncio.sleep(0.2)  # the abort has reached the engine thread: the pull is still in flight
            assert d.held == BASE_HELD + 4, "blocks freed under a pull that writes into them"
            gate.opened.set()  # the pages land (and D releases P's lease); nobody wants them now
            await until(lambda: d.metric('paged_kv_pulls_total{result="abandoned"}') == 1, "the pull abandoned")
            await idle(p, d)
            assert d.metric('paged_requests_finished_total{reason="length"}', 0) == 0  # nothing ran on D
            assert len(p.engine.producer.leases) == 0
            gate.close()

    run(main())


@pytest.mark.task("L15.8")
def test_the_proxy_answers_502_when_p_or_d_cannot_be_reached(setup):
    p, d = serve(setup, "kv_producer"), serve(setup, "kv_consumer")
    nowhere = f"http://127.0.0.1:{free_port()}"

    async def main():
        async with running(p, d):
            for prefill, decode, which in ((nowhere, "http://decode", "prefill"),
                                           ("http://prefill", nowhere, "decode")):
                mounts = {"http://prefill": httpx.ASGITransport(p.app), "http://decode": httpx.ASGITransport(d.app)}
                app = create_proxy(prefill, decode, mounts=mounts)
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy",
                                             timeout=TIMEOUT) as proxy:
                    r = await proxy.post("/v1/completions", json=body(ids(20, 21000), stream=True))
                    assert f"the {which} server" in error_of(r, 502)["message"]
                    assert (await proxy.get("/health")).status_code == 503
                    r = await proxy.get("/nowhere")
                    assert error_of(r, 404)
            await until(lambda: len(p.engine.producer.leases) == 1, "P leased for the D it could not reach")

    run(main())

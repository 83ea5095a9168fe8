"""L15's pool traces: both engines of a disaggregated pair recorded, every record replayed and checked. P's leases and
D's pulls hold blocks that no block table holds; the trace names them (lease / unlease on P, pull / pulled on D) and
the replay counts them as holders, so after every record the replayed pool equals the engine's (tests/
test_pool_trace.py's CheckedTrace: free list, ref counts, cache, tables, and P's leases). Cases: pair.py's flow in
two waves (the second hits what D pulled in the first), a pull in flight across D's steps (and one abandoned), a
failed pull under policy recompute and under fail, a lease that expires by a fake clock, and the servers' own flow
(server.py's engine loops in process: a pull held at a gate while D steps, a lease reaped while P idles). Then the
viewer: pool_viewer.py --lesson l15 and --trace twice write one page with both pools (tests/test_pool_viewer.py
opens it in a browser)."""
from __future__ import annotations

import asyncio
import io
import itertools
import json
import re
import time

import pytest

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l15_disaggregated import L15Engine
from lessons.l15_disaggregated.connector import TransferFailed, transferable
from lessons.l15_disaggregated.pair import prefill_remote, run_disaggregated
from shared.config import Qwen3Config
from shared.generation import StopRule
from shared.pool_replay import ReplayError, replay
from shared.pool_trace import PoolRecorder
from test_l3_cpp_backend import needs_kernel
from test_pool_trace import CheckedTrace, all_returned

S, N = 4, 32  # block size, pool size: prompts of a dozen tokens fill a few blocks
STOP = StopRule(4)


class Pair:
    """P and D, each recorded into a CheckedTrace (the replay checked against the engine after every record), both
    recorders stamping records from one counter (so the two traces interleave in the order things happened)."""

    def __init__(self, model, p_args: dict | None = None, d_args: dict | None = None):
        self.p = L15Engine(model, S, N, kv_role="kv_producer", connector_args=p_args)
        self.d = L15Engine(model, S, N, kv_role="kv_consumer", connector_args=d_args)
        stamp = itertools.count().__next__
        self.p_out, self.d_out = CheckedTrace(self.p), CheckedTrace(self.d)
        self.recorders = [PoolRecorder(self.p, self.p_out, "l15", stamp),
                          PoolRecorder(self.d, self.d_out, "l15", stamp)]

    def close(self) -> tuple[list[dict], list[dict]]:
        """Detach both recorders (a last record each) and stop P's page server; (P's trace, D's trace)."""
        for r in self.recorders:
            r.close()
        self.p.close()
        return trace_of(self.p_out), trace_of(self.d_out)


def settled(p: L15Engine, timeout_s: float = 5.0) -> None:
    """P steps until its page server has taken D's releases (they arrive on the server's thread) and freed the
    leases' blocks; at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    p.step()
    while len(p.producer.leases) and time.monotonic() < deadline:
        time.sleep(0.01)
        p.step()


def trace_of(out: CheckedTrace) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def events(trace: list[dict], op: str) -> list[dict]:
    return [e for r in trace[1:] for e in r["events"] if e["op"] == op]


def words(trace: list[dict]) -> list[str]:
    return [w for _, _, said in replay(trace) for w in said]


@pytest.fixture
def pairs(tiny_model):
    made: list[Pair] = []

    def make(**kwargs) -> Pair:
        made.append(Pair(tiny_model, **kwargs))
        return made[-1]

    yield make
    for pair in made:
        pair.p.close()


def test_the_disaggregated_flow_replays_on_both_engines(pairs, prompt_ids):
    """pair.py's flow twice: the second wave's prompt shares the first's prefix, so D hits what it pulled and pulls
    only the rest. Every record of both traces checks; the events name each lease and pull and say them in words."""
    pair = pairs()
    first = prompt_ids[0] + prompt_ids[1]  # 10 tokens: 2 full blocks travel
    second = first + prompt_ids[0]  # 15 tokens: 3 travel, the first 2 of them D's already
    run_disaggregated(pair.p, pair.d, [first], STOP)
    settled(pair.p)
    run = run_disaggregated(pair.p, pair.d, [second, prompt_ids[3][:13]], STOP, n=lambda i: 2 if i == 1 else 1,
                            sampling=lambda i: SamplingParams(0.8, seed=i))  # one request forks on D from its hit
    assert (run.loads[0].hits, run.loads[0].pulled) == (2, 1), run.loads[0]
    settled(pair.p)
    p_trace, d_trace = pair.close()
    assert pair.p_out.records == len(p_trace) - 1 and pair.d_out.records == len(d_trace) - 1 > 4
    assert all_returned(pair.d) and all_returned(pair.p) and not len(pair.p.producer.leases)

    leases, unleases = events(p_trace, "lease"), events(p_trace, "unlease")
    pulls, pulled = events(d_trace, "pull"), events(d_trace, "pulled")
    assert len(leases) == len(unleases) == len(pulls) == len(pulled) == 3
    assert {e["why"] for e in unleases} == {"released"} and {e["outcome"] for e in pulled} == {"filed"}
    assert [e["lease"] for e in pulls] == [e["lease"] for e in leases], "D pulls the leases P granted, in order"
    assert [len(e["blocks"]) for e in leases] == [transferable(len(p), S) for p in (first, second, prompt_ids[3][:13])]
    assert [e["hits"] for e in pulls] == [0, 2, 0]
    assert all(e["seq"] is not None for e in leases), "engine.request_finished names the request"

    # The two traces interleave in the order things happened: a lease, then its pull, then its end on P.
    at = {(e["op"], e.get("lease")): r["at"] for t in (p_trace, d_trace) for r in t[1:] for e in r["events"]
          if e["op"] in ("lease", "unlease", "pull")}
    for e in leases:
        assert at["lease", e["lease"]] < at["pull", e["lease"]] < at["unlease", e["lease"]], e["lease"]
    assert all(a["at"] < b["at"] for t in (p_trace, d_trace) for a, b in zip(t, t[1:])), "each trace in order"

    p_words, d_words = "\n".join(words(p_trace)), "\n".join(words(d_trace))
    assert f"blocks {leases[0]['blocks']} leased to the decode engine (lease {leases[0]['lease'][:8]}" in p_words
    assert f"lease {leases[0]['lease'][:8]} released by the decode engine: blocks {leases[0]['blocks']}" in p_words
    fresh = pulls[1]["blocks"][2:]
    assert f"pulled 1 block(s) from the prefill engine into {fresh}; they enter the prefix cache" in d_words
    assert f"block(s) {pulls[1]['blocks'][:2]} this engine's own cache held already" in d_words
    assert "admitted with a prefix-cache hit: 12 tokens (3 blocks)" in d_words, d_words


def test_a_pull_in_flight_holds_its_blocks_across_steps(pairs, prompt_ids):
    """The servers' way: start on the engine thread, D steps other requests while the pages come, finish later. The
    records between hold the pull's references, which no table explains; then one pull is abandoned."""
    pair = pairs()
    p, d = pair.p, pair.d
    prompt = prompt_ids[0] + prompt_ids[1] + prompt_ids[0]  # 3 blocks travel
    params = prefill_remote(p, [prompt, prompt_ids[3][:9]], StopRule(1))
    pending = d.consumer.start(prompt, params[0])
    other = d.add_request(prompt_ids[2] * 3, StopRule(3))
    d.step()
    assert pair.d_out.state.pulls == {0: pending.hits + pending.fresh} and len(pending.fresh) == 3
    d.consumer.pull(pending)
    d.step()
    d.consumer.finish(pending)
    gone = d.consumer.start(prompt_ids[3][:9], params[1])
    d.step()
    d.consumer.pull(gone)
    d.consumer.abandon(gone)  # its client left while the pages were in flight
    while d.scheduler.has_work():
        d.step()
    settled(p)
    p_trace, d_trace = pair.close()  # D's abandon came after its last step: its record is the closing one
    assert other.output_ids and pair.d_out.state.pulls == {} and pair.p_out.state.leases == {}
    assert [e["outcome"] for e in events(d_trace, "pulled")] == ["filed", "abandoned"]
    held = [r for r in d_trace[1:] if r["kind"] == "step" and r["plan"]][0]
    assert not any(e["op"] == "pulled" for e in held["events"]), "the first step ran with the pull in flight"
    text = "\n".join(words(d_trace))
    assert f"pull 1 abandoned (its client left): blocks {gone.hits + gone.fresh} freed" in text, text
    assert f"pull 0 still holds blocks {pending.hits + pending.fresh}: held by no table" in text, text


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_pull_frees_its_blocks_unregistered(pairs, prompt_ids, policy):
    """P gone before D pulls: under recompute the request computes its prompt on D; under fail it is refused. Either
    way the pull's blocks go back unregistered, and the trace says so."""
    pair = pairs(d_args={"policy": policy})
    p, d = pair.p, pair.d
    prompt = prompt_ids[0] * 2
    params = prefill_remote(p, [prompt], StopRule(1))[0]
    p.close()  # the prefill engine goes away with the lease
    if policy == "fail":
        with pytest.raises(TransferFailed):
            d.consumer.load(prompt, params)
    else:
        assert d.consumer.load(prompt, params).failed
        d.add_request(prompt, STOP)
        while d.scheduler.has_work():
            d.step()
    _, d_trace = pair.close()
    (ended,) = events(d_trace, "pulled")
    assert ended["outcome"] == ("refused" if policy == "fail" else "recompute") and ended["error"]
    ending = next(r for r in d_trace[1:] if ended in r["events"])
    assert not [e for e in ending["events"] if e["op"] == "register"], "a failed pull registers nothing"
    text = "\n".join(words(d_trace))
    then = "the request is refused (policy fail)" if policy == "fail" else "the prompt is computed here instead"
    assert f"pull 0 failed ({ended['error']}): blocks {ended['blocks']} freed" in text and then in text, text
    if policy == "recompute":
        assert "prefills tokens 0..9 (10)" in text, "no hit: the whole prompt computed on D"


def test_a_lease_nobody_pulls_expires_and_p_frees_it(pairs, prompt_ids):
    """A fake clock past the lease's deadline: P's next step reaps it. The lease's references were the lease's,
    and the trace names its end as an expiry."""
    now = [0.0]
    pair = pairs(p_args={"lease_s": 30.0, "clock": lambda: now[0]})
    params = prefill_remote(pair.p, [prompt_ids[0] + prompt_ids[1]], StopRule(1))[0]
    pair.p.step()
    assert len(pair.p_out.state.leases) == 1, "not expired yet: still held"
    now[0] = 30.0
    pair.p.step()
    assert pair.p_out.state.leases == {}
    p_trace, _ = pair.close()
    (ended,) = events(p_trace, "unlease")
    assert ended["why"] == "expired" and ended["blocks"] == params["remote_block_ids"]
    assert f"lease {ended['lease'][:8]} expired before a pull released it" in "\n".join(words(p_trace))


def test_the_replay_refuses_a_trace_that_hides_a_holder(pairs, prompt_ids):
    """Without its lease event, P's leased blocks hold references nobody explains (and its end names a lease never
    granted); without its pull event, D's pull ends without having started; an unlease of other blocks lies too."""
    pair = pairs()
    run_disaggregated(pair.p, pair.d, [prompt_ids[0] + prompt_ids[1]], STOP)
    settled(pair.p)
    p_trace, d_trace = pair.close()
    assert replay(p_trace) and replay(d_trace)
    for op in ("lease", "pull"):
        trace = json.loads(json.dumps(p_trace if op == "lease" else d_trace))
        record = next(r for r in trace[1:] if any(e["op"] == op for e in r["events"]))
        record["events"] = [e for e in record["events"] if e["op"] != op]
        with pytest.raises(ReplayError, match="ref count|never"):
            replay(trace)
    trace = json.loads(json.dumps(p_trace))
    next(e for r in trace[1:] for e in r["events"] if e["op"] == "unlease")["blocks"].append(99)
    with pytest.raises(ReplayError, match="ended with blocks"):
        replay(trace)


def test_recording_off_leaves_the_connectors_as_they_were(tiny_model):
    """The recorder wraps the connectors' methods on the engine's own instances, and only while attached."""
    p = L15Engine(tiny_model, S, N, kv_role="kv_producer")
    d = L15Engine(tiny_model, S, N, kv_role="kv_consumer")
    try:
        objects = [p, p.producer, p.producer.leases, d, d.consumer]
        before = [dict(vars(o)) for o in objects]
        recorders = [PoolRecorder(p, CheckedTrace(p), "l15"), PoolRecorder(d, CheckedTrace(d), "l15")]
        assert {"request_finished"} <= set(vars(p.producer)) and "reap" in vars(p.producer.leases)
        assert {"start", "finish", "abandon"} <= set(vars(d.consumer))
        for r in recorders:
            r.close()
        assert [dict(vars(o)) for o in objects] == before
    finally:
        p.close()


def test_the_viewer_draws_both_pools_from_a_run_or_from_two_traces(tmp_path, capsys):
    """pool_viewer.py --lesson l15 records P and D (each trace replays and checks), writes one page with both pools
    and a slider over both; --trace twice draws the saved traces the same way. (tests/test_pool_viewer.py opens
    such a page in a browser.)"""
    from shared.pool_page import DATA_MARK, PANES_TEMPLATE
    from shared.pool_trace import read_trace
    from test_bad_input import run_script

    page, p_path, d_path = tmp_path / "l15.html", tmp_path / "p.jsonl", tmp_path / "d.jsonl"
    code, out, err = run_script("pool_viewer.py", ["--lesson", "l15", "--out", str(page), "--save-trace", str(p_path),
                                                   "--save-trace", str(d_path), "--requests", "4"], capsys)
    assert code == 0 and "prefill engine P" in out and "decode engine D" in out and "in wall order" in out, err
    p_trace, d_trace = read_trace(p_path), read_trace(d_path)
    assert replay(p_trace) and replay(d_trace)
    assert len(events(p_trace, "lease")) == len(events(d_trace, "pulled")) == 4
    assert [e["hits"] for e in events(d_trace, "pull")][1:] == [3, 3, 3], "the later prompts hit the system prompt"
    html = page.read_text()
    assert DATA_MARK not in html and html.count("<iframe") == 0 and "<script" not in html.split("const DATA = ")[1]
    again = tmp_path / "again.html"
    code, out, err = run_script("pool_viewer.py", ["--trace", str(p_path), "--trace", str(d_path), "--out",
                                                   str(again)], capsys)
    assert code == 0 and again.read_text() == html, err
    panes = PANES_TEMPLATE.read_text()  # self-contained as the one-pool page: no address, nothing loaded
    assert panes.count(DATA_MARK) == 1
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/|\bsrc\s*=|@import|url\(", panes, re.I)


@pytest.mark.parametrize("argv, says", [
    (["--lesson", "l15", "--save-trace", "p.jsonl"], "--lesson l15 records two engines: give it twice"),
    (["--lesson", "l6", "--save-trace", "a", "--save-trace", "b"], "--lesson l6 records one engine: give it once"),
    (["--trace", "{tmp}/p.jsonl", "--trace", "{tmp}/bad.jsonl"], "--trace {tmp}/bad.jsonl: not a pool trace (its"),
])
def test_the_viewer_refuses_bad_pairs_in_one_line(argv, says, tmp_path, capsys):
    from test_bad_input import run_script

    (tmp_path / "bad.jsonl").write_text('{"kind": "step"}\n')
    (tmp_path / "p.jsonl").write_text(json.dumps({"kind": "header"}) + "\n")
    code, _, err = run_script("pool_viewer.py", [a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert code == 2 and err.count("\n") == 1 and says.replace("{tmp}", str(tmp_path)) in err, err


class Collected(CheckedTrace):
    """CheckedTrace for an engine thread: a mismatch is kept for the test to report, not raised in the server."""

    def __init__(self, engine):
        super().__init__(engine)
        self.problems: list[str] = []

    def write(self, line: str) -> int:
        try:
            return super().write(line)
        except (AssertionError, ReplayError) as e:
            self.problems.append(str(e))
            return io.StringIO.write(self, line)


@needs_kernel  # L14's mode, as test_l15_serving.py runs the servers
def test_the_servers_flow_replays_a_pull_held_in_flight_and_a_lease_reaped_while_idle(tiny_model, tokenizer,
                                                                                     tiny_dir):
    """P's and D's servers (server.py's engine loops, in process) recorded as serve.py --trace records them, with no
    stamp given: the connectors are found and watched; D's pull is started on its engine thread, held at a gate
    while D serves another request, filled by a worker and finished on the engine thread; a lease nobody pulls
    expires while P idles. Every record of both traces checks against its engine."""
    from test_l15_serving import BASE_HELD, TIMEOUT, Gate, body, idle, lease, proxy_for, running, serve, until

    setup = (tiny_model, tokenizer, Qwen3Config.from_dir(tiny_dir))
    p, d = serve(setup, "kv_producer", lease_s=3.0), serve(setup, "kv_consumer")  # long enough for the gated pull
    outs = [Collected(p.engine), Collected(d.engine)]
    recorders = [PoolRecorder(p.engine, outs[0], "l15"), PoolRecorder(d.engine, outs[1], "l15")]
    first, held, other = list(range(1000, 1040)), list(range(2000, 2040)), list(range(3000, 3010))

    async def main():
        async with running(p, d) as (p_client, d_client):
            proxy = proxy_for(p, d)
            assert (await proxy.post("/v1/completions", json=body(first, 3))).status_code == 200
            await proxy.aclose()
            gate = Gate(p.engine.producer.server.address)
            pulling = asyncio.create_task(d_client.post("/v1/completions", json=body(
                held, 3, kv_transfer_params=gate.via(await lease(p_client, body(held))))))
            await asyncio.to_thread(gate.accepted.wait, TIMEOUT)  # D took the blocks; the pages wait at the gate
            assert (await d_client.post("/v1/completions", json=body(other, 4))).status_code == 200  # D steps
            gate.opened.set()
            assert (await asyncio.wait_for(pulling, TIMEOUT)).status_code == 200
            gate.close()
            await lease(p_client, body(other))  # nobody pulls it: it expires while P idles
            await until(lambda: p.held == BASE_HELD and not len(p.engine.producer.leases), "the lease expired")
            await idle(p, d)

    asyncio.run(main())
    for r in recorders:
        r.close()
    assert outs[0].problems == [] and outs[1].problems == []
    p_trace, d_trace = trace_of(outs[0]), trace_of(outs[1])
    assert all(isinstance(r.get("at"), float) for r in p_trace + d_trace), "L15's records carry the wall time"
    assert sorted(e["why"] for e in events(p_trace, "unlease")) == ["expired", "released", "released"]
    assert [e["outcome"] for e in events(d_trace, "pulled")] == ["filed", "filed"]
    fed = [set(state.pulls) for record, state, _ in replay(d_trace) if record["plan"]]
    assert {1} in fed, "D stepped (its other request) with the gated pull holding its blocks"

"""L10 on real ranks (gloo, on this CPU): the split model's tokens equal the single-rank engine's and HF's.

- One 2-rank group for the module (torch.distributed's default group is one per process): rank 1 spawned
  here, the split model loaded on both, an L10Engine (graphs on, sizes 1, 2, 4) on top.
  * A workload with it all: staggered arrivals (continuous batching), a 101-token prompt cut into slices by a
    small token budget, a later prompt that shares its first four blocks (a prefix hit). Every request's
    greedy tokens equal L8's on one rank (same workload) and HF's for the prompt alone; rank 0 made exactly
    9 all-reduces per forward (2 per layer + the embedding) and one logits gather per forward that samples.
  * n = 2 seeded sampling: the fork's copy-on-write is recorded by rank 0's block manager and made by both
    ranks with the next step; the children equal L8's.
  * After each run every block is free or cached; no deferred copy is left behind.
- Every listening socket of both ranks is on loopback (no TCPStore on every interface); the store is a file
  in a 0700 folder.
- scripts/l10_smoke.py in its own process: --tp 4 (KV heads replicated) matches; --tp 3 is refused (exit 2,
  one line); --tp 2 --json carries both the L10 and the L8 verdict of every prompt.
- A follower killed between two steps, or hung (SIGSTOP) inside one or between two, ends rank 0's run with
  RunFailure, one line naming the rank, in seconds (tests/l10_fault.py, a process each): rank 0's sends of
  a step are bounded by the timeout too, only a follower's wait for the next step is not.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from lessons.l4_continuous.engine import Arrival
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l8_chunked_prefill import L8Engine
from lessons.l10_tensor_parallel import L10Engine
from lessons.l10_tensor_parallel.launch import start
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM
from shared.generation import StopRule

# Slow (process groups of two and four ranks, hung and dead followers waited out).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
BLOCK, BUDGET, MAX_RUNNING, NEW = 16, 24, 8, 8
SIZES = [1, 2, 4]  # captured decode sizes: replays (and captures) are steps the followers must run too
SCRIPT_TIMEOUT = 300  # a hang guard for the subprocesses, far above their run time


def engine_kwargs() -> dict:
    return dict(graphs=True, capture_sizes=SIZES, max_batched_tokens=BUDGET)


@pytest.fixture(scope="module")
def tp_engine(tiny_dir):
    group = start(2, CPU, 60)
    try:
        model = TpQwen3ForCausalLM.load(tiny_dir, torch.float32, group)
        engine = L10Engine(model, BLOCK, None, MAX_RUNNING, "torch", **engine_kwargs())
    except BaseException:
        group.close()
        raise
    yield engine
    engine.close()


def l8_engine(tiny_model) -> L8Engine:
    return L8Engine(tiny_model, BLOCK, None, MAX_RUNNING, "torch", **engine_kwargs())


def stop_for(model) -> StopRule:
    return StopRule(NEW, frozenset(model.config.eos_token_ids), ignore_eos=True)


def assert_no_leak(engine) -> None:
    """Every block free or cached; only L7's dummy block is still referenced."""
    assert engine.allocator.num_free == engine.usable_blocks
    assert [b for b, r in enumerate(engine.allocator.ref) if r] == [engine.dummy_block]


class Forwards:
    """Counts rank 0's runner forwards during a run: all of them, and those that sample (gather logits)."""

    def __init__(self, engine):
        self.runner, self.all, self.sampling = engine.runner, 0, 0
        inner = type(self.runner).forward

        def forward(slices):
            self.all += 1
            self.sampling += any(s.samples for s in slices)
            return inner(self.runner, slices)

        self.runner.forward = forward

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        del self.runner.forward  # the class's method again


def test_workload_matches_l8_and_hf_with_9_all_reduces_per_forward(tp_engine, tiny_model, hf, prompt_ids):
    stop = stop_for(tiny_model)
    short, long = prompt_ids[:3], prompt_ids[3]
    assert len(long) > 4 * BLOCK + BUDGET
    sequel = long[:4 * BLOCK] + prompt_ids[0]  # its first 4 blocks are the long prompt's
    # The long prompt alone first (its first slice samples nothing: no logits to gather), then the others.
    prompts, arrive = [long, short[0], short[1], short[2], sequel], [0, 1, 1, 3, 10]

    def workload(clock: int) -> list[Arrival]:  # arrival steps counted from the engine's clock now
        return [Arrival(p, stop, step=clock + t) for p, t in zip(prompts, arrive)]

    group, engine = tp_engine.model.tp, tp_engine
    reduces, gathers = group.calls["all-reduce"], group.calls["gather"]
    steps, hits = len(engine.step_tokens), engine.stats.cached_tokens
    with Forwards(engine) as forwards:
        got = engine.run(workload(engine.clock))
    single = l8_engine(tiny_model)
    want = single.run(workload(single.clock))
    for i, prompt in enumerate(prompts):
        assert got[i] == want[i] == hf.generate(prompt, stop).tokens, f"request {i}"
    # The workload did what it is for.
    assert engine.stats.cached_tokens - hits >= 4 * BLOCK, "the sequel hit the long prompt's blocks"
    assert max(engine.prompt_slices.values()) > 1, "the long prompt was cut into slices"
    assert max(engine.step_tokens[steps:]) <= BUDGET
    assert sum(engine.runner.replays.values()) > 0, "some decode steps replayed a captured size"
    # The collectives rank 0 made: 2 per layer + the embedding, every forward; a gather when it samples.
    per_forward = 2 * tiny_model.config.num_hidden_layers + 1
    assert per_forward == 9
    assert forwards.all == len(engine.step_tokens) - steps > 0
    assert group.calls["all-reduce"] - reduces == per_forward * forwards.all
    assert group.calls["gather"] - gathers == forwards.sampling < forwards.all  # slices mid-prompt sample nothing
    assert engine.step_tokens[steps:] == single.step_tokens  # the same plan, step for step
    assert_no_leak(engine)
    assert engine.allocator.pending_copies == []


def test_forked_sampling_copies_on_write_on_every_rank(tp_engine, tiny_model, hf, prompt_ids):
    """n = 2 on a 5-token prompt (one partial block, shared by both children after the fork): the first
    child to write copies the block. L10's copy is recorded and made by both ranks before the step that
    writes into it; skip it and that child attends over a block that lacks the prompt's K/V."""
    stop, sampling = stop_for(tiny_model), SamplingParams(0.8, top_k=50, seed=23)
    prompt = prompt_ids[0]
    assert len(prompt) % BLOCK
    outs, cows = {}, {}
    for name, engine in (("L10", tp_engine), ("L8", l8_engine(tiny_model))):
        before = engine.stats.cow_copies
        kids = engine.add_parallel(prompt, stop, sampling, n=2)
        greedy = engine.add_request(prompt_ids[1], stop)
        while engine.scheduler.has_work():
            engine.step()
        outs[name] = [k.output_ids for k in kids] + [greedy.output_ids]
        cows[name] = engine.stats.cow_copies - before
        assert_no_leak(engine)
    assert cows == {"L10": 1, "L8": 1}
    assert tp_engine.allocator.pending_copies == []  # the copy went out with a step
    assert outs["L10"] == outs["L8"]
    assert outs["L10"][2] == hf.generate(prompt_ids[1], stop).tokens
    assert outs["L10"][0] != outs["L10"][1] and all(len(k) == NEW for k in outs["L10"])


# --- what the ranks expose ------------------------------------------------------------------------------------


def listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) of the TCP sockets pid listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed while we looked
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN, and one of pid's sockets
                found.append(fields[1].rsplit(":", 1)[0])
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1


def test_the_ranks_listen_on_loopback_only_and_meet_at_a_private_store(tp_engine):
    """No listening socket of either rank is reachable from another machine (a TCPStore listens on every
    interface, unauthenticated; gloo binds where GLOO_SOCKET_IFNAME says), and the store is a file in a
    folder only this user can enter."""
    [rank1] = [p for p in multiprocessing.active_children() if p.name == "tp-rank-1"]
    addresses = {pid: listening(pid) for pid in (os.getpid(), rank1.pid)}
    assert all(addresses.values()), f"each rank listens for its peers (gloo): {addresses}"
    assert all(a in LOOPBACK for found in addresses.values() for a in found), addresses
    folders = [Path(tempfile.gettempdir()) / d for d in os.listdir(tempfile.gettempdir()) if d.startswith("l10-tp-")]
    mine = [f for f in folders if f.stat().st_uid == os.getuid() and (f / "store").exists()]
    assert mine and all(stat.S_IMODE(f.stat().st_mode) == 0o700 for f in mine), mine


# --- scripts/l10_smoke.py, each run a process of its own ----------------------------------------------------


def run(args: list[str], timeout: float = SCRIPT_TIMEOUT) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_smoke_tp4_replicates_kv_heads_and_matches():
    p = run(["scripts/l10_smoke.py", "--tp", "4", "--max-new-tokens", "6", "--json"])
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout)
    assert result["match"] and result["extra_check"]["ok"], result["extra_check"]
    assert all(q["L10"] == q["L8"] == q["hf"] and len(q["hf"]) > 0 for q in result["prompts"])
    message = result["extra_check"]["message"]
    assert "L10 on 4 rank(s) (gloo)" in message and "KV head(s) 0 of 2 (replicated)" in message
    assert "(9 per forward" in message


def test_smoke_tp3_is_refused_in_one_line():
    p = run(["scripts/l10_smoke.py", "--tp", "3"])
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines == ["error: --tp 3 does not divide the model's 4 attention heads"], p.stderr[-2000:]
    assert p.stdout == ""


def test_smoke_tp2_json_has_l10_and_l8_verdicts():
    p = run(["scripts/l10_smoke.py", "--tp", "2", "--max-new-tokens", "4", "--json"])
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout)
    assert result["lesson"] == "L10" and result["match"] and result["extra_check"]["ok"]
    for q in result["prompts"]:
        assert q["L10_verdict"]["status"] == q["L8_verdict"]["status"] == "match"
        assert q["L10_verdict"]["judged"] == q["L8_verdict"]["judged"] == len(q["hf"]) > 0
        assert q["L10"] == q["L8"] == q["hf"]
    message = result["extra_check"]["message"]
    assert "L10 on 2 rank(s) (gloo)" in message and "KV head(s) 0 of 2," in message and "(LEAK)" not in message


# --- a follower that dies or hangs mid-run ---------------------------------------------------------------------


def fault_run(mode: str, timeout_s: float) -> dict:
    p = run(["tests/l10_fault.py", mode, str(timeout_s)], timeout=120)
    assert p.stdout.strip(), p.stderr[-2000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert "hung" not in result, f"rank 0 hung ({result}); stderr: {p.stderr[-2000:]}"
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    return result


def test_a_killed_follower_fails_the_next_step_with_one_line():
    r = fault_run("kill", 10)
    assert r["error"] == "RunFailure" and r["steps_after"] == 0, r  # the very next step, not a later one
    msg = r["message"]
    assert "\n" not in msg and msg.startswith("tensor-parallel rank 0 of 2: ")
    assert "10 s timeout" in msg
    assert r["seconds_to_failure"] < 60  # a hang guard, not a timing claim
    assert r["closed"]


def test_a_hung_follower_fails_the_step_at_the_timeout():
    """Rank 1 stopped right after it was sent a step: rank 0 waits in an all-reduce of that step, which the
    compute group's 3 s timeout ends."""
    r = fault_run("stop-in-step", 3)
    assert r["error"] == "RunFailure" and r["steps_after"] == 0, r
    msg = r["message"]
    assert "\n" not in msg and msg.startswith("tensor-parallel rank 0 of 2: all-reduce failed")
    assert "3 s timeout" in msg
    assert r["seconds_to_failure"] < 60  # a hang guard, not a timing claim
    assert r["closed"]


def test_a_follower_hung_between_steps_fails_the_next_step_at_the_timeout():
    """Rank 1 stopped while it waits for rank 0's next step: rank 0's next step must fail within about the
    timeout, as a step whose all-reduce waits on it does, instead of hanging in the step's broadcast."""
    r = fault_run("stop", 3)
    assert r["error"] == "RunFailure" and r["steps_after"] == 0, r
    msg = r["message"]
    assert "\n" not in msg and msg.startswith("tensor-parallel rank 0 of 2: ") and "3 s timeout" in msg
    assert r["closed"]

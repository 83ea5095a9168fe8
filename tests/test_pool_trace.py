"""The pool trace and its replay: after every step of randomized workloads, the pool rebuilt from the trace alone
equals the engine's own (free list order, reference counts, cached blocks, the prefix cache's keys, every block
table, the host pool). So the viewer's picture is the engine's. Workloads mix arrivals, aborts, n > 1 forks,
both preemption policies, speculation with rejected drafts and chunked prefill, on the fake runner (fast, and
it fails at once on a block lost, shared or restored wrongly); L2 and L3, which have no scheduler, run a short
workload on the embedded model (tests/test_pool_viewer.py records every lesson's run so, checked the same way)."""
from __future__ import annotations

import io
import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_runner import VOCAB, FakeChunkRunner, FakeRunner, encode_k, encode_v, fake_model, logits_for
from lessons.l4_continuous import L4Engine
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l5_preemption import L5Engine
from lessons.l6_prefix_sharing import L6Engine
from lessons.l8_chunked_prefill import L8Engine
from lessons.l9_server.engine import L9Engine
from lessons.l11_speculative import L11Engine
from lessons.l11_speculative.drafter import Draft
from shared.errors import CourseError
from shared.generation import StopRule
from shared.pool_replay import PoolState, ReplayError, replay
from shared.pool_trace import PoolRecorder, pool_state

WATCHED = ("alloc", "free", "share", "copy_on_write", "step", "schedule", "preempt", "fork", "roll_back",
           "swap_out", "swap_in", "abort", "with_drafts", "register", "drop", "forward", "model")


class CheckedTrace(io.StringIO):
    """The recorder's output stream: each line, as it is written, is applied to a replay, and the replay's pool
    must equal the engine's at that moment (a record is written at the end of its step)."""

    def __init__(self, engine):
        super().__init__()
        self.engine, self.state, self.records = engine, None, 0

    def write(self, line: str) -> int:
        record = json.loads(line)
        if record["kind"] == "header":
            self.state = PoolState.from_header(record)
        else:
            self.state.apply(record)
            self.records += 1
        want, got = pool_state(self.engine), self.state.as_dict()
        if getattr(self.engine, "scheduler", None) is None:  # L2, L3: their requests are out of sight
            for k in ("tables", "host_tables"):
                want.pop(k), got.pop(k)
        assert got == want, f"record {self.records} ({record.get('kind')} {record.get('step')}): replay != engine"
        return super().write(line)


def all_returned(engine) -> bool:
    """Every block back in the pool but L7's dummy block (held for padded rows, never returned)."""
    return engine.allocator.num_free == engine.allocator.num_blocks - (getattr(engine, "dummy_block", None) is not None)


def attach(engine) -> tuple[PoolRecorder, CheckedTrace]:
    out = CheckedTrace(engine)
    return PoolRecorder(engine, out, "test"), out


# --- engines on the fake runner ---

class FakeSpecRunner(FakeChunkRunner):
    """FakeChunkRunner with a logits row for every position a decode feeds (a verify slice's drafts)."""

    def forward(self, slices) -> torch.Tensor:
        self.eager_steps += 1
        rows = []
        for s in slices:
            tokens, start = s.token_ids(0, s.num_tokens), s.num_cached  # a verify slice's drafts included
            for p in range(start, s.num_tokens):
                b, o = self._slot(s, p)
                for layer, (k, v) in enumerate(zip(self.pool.k, self.pool.v)):
                    k[b, o, 0, 0], v[b, o, 0, 0] = encode_k(tokens[p], layer), encode_v(tokens[p], layer)
            history = [self._read(s, p) for p in range(s.num_tokens)]
            s.num_cached = s.num_tokens
            if s.decode:
                rows += [logits_for(history[:p + 1]) for p in range(start, s.num_tokens)]
            elif s.samples:
                rows.append(logits_for(history))
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


class FakeDrafter:
    """Proposes the fake model's own greedy continuation with about a third of the tokens made wrong."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def bind(self, engine) -> None:
        pass

    def propose(self, decodes, limits) -> list[Draft]:
        drafts = []
        for piece, k in zip(decodes, limits):
            history, tokens = piece.seq.prompt_ids + piece.seq.output_ids, []
            for _ in range(k):
                t = int(logits_for(history).argmax())
                t = (t + 1) % VOCAB if self.rng.random() < 0.35 else t
                tokens.append(t)
                history = history + [t]
            drafts.append(Draft(tokens))
        return drafts


class FakeL8(L8Engine):
    runner_class = FakeChunkRunner


class FakeL9(L9Engine):
    runner_class = FakeChunkRunner


class FakeL11(L11Engine):
    runner_class = FakeSpecRunner


def make(kind: str, S: int, N: int, budget: int, seed: int):
    m = fake_model()
    if kind == "l4":
        return L4Engine(m, S, N, runner=FakeRunner(S, N))
    if kind in ("l5", "l5-swap"):
        return L5Engine(m, S, N, runner=FakeRunner(S, N), policy="swap" if kind == "l5-swap" else "recompute",
                        host_blocks=N // 2)
    if kind == "l6":
        return L6Engine(m, S, N, runner=FakeRunner(S, N))
    chunked = dict(graphs=False, max_batched_tokens=budget)
    if kind == "l8":
        return FakeL8(m, S, N, **chunked)
    if kind == "l9":
        return FakeL9(m, S, N, **chunked)
    return FakeL11(m, S, N, drafter=FakeDrafter(seed), num_speculative_tokens=3, **chunked)


KINDS = ("l4", "l5", "l5-swap", "l6", "l8", "l9", "l11")

request = st.tuples(st.integers(1, 14), st.integers(1, 9), st.integers(0, 3), st.sampled_from([1, 1, 1, 2, 3]),
                    st.one_of(st.none(), st.integers(0, 6)))  # prompt length, max new, gap, n, abort after k steps


def drive(engine, requests, seed: int) -> int:
    """Submit each request after its gap; abort some after a few steps (L9 on). Returns the steps run."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(6)]  # a shared system prompt: prefix hits from L6 on
    pending = list(requests)
    aborts: list[tuple[int, object]] = []
    clock, steps, wait = 0, 0, 0
    while pending or engine.scheduler.has_work():
        while pending and wait <= 0:
            plen, max_new, gap, n, abort_after = pending.pop(0)
            prompt = (prefix if rng.random() < 0.6 else []) + [rng.randrange(VOCAB) for _ in range(plen)]
            stop = StopRule(max_new)
            try:
                if n > 1 and hasattr(engine, "add_parallel"):
                    group = engine.add_parallel(prompt, stop, SamplingParams(0.9, seed=rng.randrange(1000)), n)
                else:
                    group = [engine.add_request(prompt, stop)]
            except CourseError:  # larger than the whole pool: refused, nothing changed
                group = []
            if abort_after is not None and hasattr(engine, "abort") and group:
                aborts.append((steps + abort_after, group))
            wait = gap
        if engine.scheduler.has_work():
            engine.step()
            steps += 1
        wait -= 1
        clock += 1
        for due, group in [a for a in aborts if a[0] <= steps]:
            engine.abort(group)
            aborts.remove((due, group))
        assert steps < 2000
    return steps


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), S=st.integers(1, 5), N=st.integers(8, 28), budget=st.integers(3, 24),
       requests=st.lists(request, min_size=1, max_size=9), seed=st.integers(0, 2**16))
def test_replay_equals_the_engine_after_every_step(kind, S, N, budget, requests, seed):
    engine = make(kind, S, N, budget, seed)
    recorder, out = attach(engine)
    drive(engine, requests, seed)
    recorder.close()
    assert all_returned(engine)  # and the last record showed it
    assert sum(1 for line in out.getvalue().splitlines()) == out.records + 1
    assert not (recorder.known or recorder.tables or recorder.lengths)  # a server's recorder forgets the finished


def test_the_workloads_exercise_every_event():
    """The property test is only as good as what its workloads do: each kind of event occurs in a fixed sample."""
    seen: set[str] = set()
    for kind in KINDS:
        for seed in range(6):
            rng = random.Random(seed)
            reqs = [(rng.randint(1, 14), rng.randint(1, 9), rng.randint(0, 2), rng.choice([1, 2, 3]),
                     rng.choice([None, 1, 3])) for _ in range(8)]
            engine = make(kind, 2, 12, 6, seed)
            recorder, out = attach(engine)
            drive(engine, reqs, seed)
            recorder.close()
            seen |= {e["op"] for line in out.getvalue().splitlines()[1:] for e in json.loads(line)["events"]}
            seen |= {"draft" for line in out.getvalue().splitlines()[1:] for p in json.loads(line)["plan"]
                     if p.get("drafts")}
    want = {"alloc", "free", "share", "cow", "register", "evict", "preempt", "swap_out", "swap_in", "fork",
            "rollback", "abort", "draft"}
    assert want <= seen, want - seen


def test_recording_off_leaves_the_engine_as_it_was():
    """No cost when off: a recorder wraps methods on the engine's own objects only while attached."""
    engine = make("l11", 4, 16, 8, 0)
    objects = [engine, engine.allocator, engine.allocator.cache, engine.scheduler, engine.runner]
    before = [dict(vars(o)) for o in objects]
    recorder, _ = attach(engine)
    assert "alloc" in vars(engine.allocator) and "step" in vars(engine)
    recorder.close()
    for o, was in zip(objects, before):
        assert not set(vars(o)) & set(WATCHED) - set(was), type(o).__name__
    assert type(engine).step is L11Engine.step and engine.step.__func__ is L11Engine.step


def test_the_replay_refuses_a_trace_that_lies():
    engine = make("l6", 2, 10, 6, 1)
    out = io.StringIO()
    recorder = PoolRecorder(engine, out, "test")
    drive(engine, [(5, 4, 0, 2, None), (7, 3, 1, 1, None)], 1)
    recorder.close()
    trace = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replay(trace)  # the true trace replays
    for lie in ("drop a free", "swap two blocks", "forget a table"):
        bad = json.loads(json.dumps(trace))
        record = next(r for r in bad[1:] if any(e["op"] == "free" for e in r["events"]) and r["tables"])
        if lie == "drop a free":
            record["events"] = [e for e in record["events"] if e["op"] != "free"]
        elif lie == "swap two blocks":
            first = next(r for r in bad[1:] if any(e["op"] == "alloc" and len(e["blocks"]) > 1 for e in r["events"]))
            e = next(e for e in first["events"] if e["op"] == "alloc" and len(e["blocks"]) > 1)
            e["blocks"][0], e["blocks"][1] = e["blocks"][1], e["blocks"][0]
        else:
            first = next(r for r in bad[1:] if r["tables"])
            first["tables"] = {}
        with pytest.raises(ReplayError):
            replay(bad)


@pytest.mark.slow  # the embedded model's forwards: 15 s
@pytest.mark.parametrize("lesson", ["l2", "l3"])
def test_the_lessons_without_a_scheduler(lesson, tiny_model):
    """L2 and L3 have no step(): a recorder watches their forwards (L2's model, L3's runner). The same check after
    every record, on the embedded model. (tests/test_pool_viewer.py's pages check every lesson so, in a browser.)"""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from pool_viewer import build, run, workload

    args = argparse.Namespace(block_size=4, num_blocks=24, requests=4, stagger=1, seed=3, policy="recompute")
    engine = build(lesson, tiny_model, args)
    recorder, out = attach(engine)
    run(engine, lesson, workload(tiny_model.config.vocab_size, args), args)
    recorder.close()
    assert out.records > 5
    assert all_returned(engine)


def test_a_live_pool_keeps_its_last_records_and_folds_the_rest():
    """serve.py --pool-viewer's trace: only the last `keep` records are kept; older ones are folded into the pool
    they start from, so the frames it serves equal a full replay's, and finished requests are forgotten."""
    from shared.pool_live import LivePool

    engine = make("l9", 2, 14, 6, 3)
    live, full = LivePool(keep=5), CheckedTrace(engine)

    class Both:
        def write(self, line: str) -> int:
            live.write(line)
            return full.write(line)

        def flush(self) -> None:
            pass

    recorder = PoolRecorder(engine, Both(), "test")
    drive(engine, [(9, 6, 0, 2, None), (4, 8, 1, 1, 2), (12, 5, 0, 1, None), (3, 7, 2, 3, None)], 3)
    recorder.close()
    got = live.frames(after=-1)
    assert got["next"] == full.records and [f["index"] for f in got["frames"]] == list(range(full.records - 5, full.records))
    last = got["frames"][-1]
    assert last["tables"] == {str(i): t for i, t in full.state.tables.items()} and last["ref"] == full.state.ref
    assert live.frames(after=full.records - 2)["frames"][0]["index"] == full.records - 1
    assert len(live.base.seqs) < len(full.state.seqs)  # the folded finished requests are gone


@pytest.mark.parametrize("argv, says", [
    (["--lesson", "l1"], "--lesson l1: use one of l2, l3"),
    (["--lesson", "l10"], "python scripts/l10_smoke.py --trace FILE"),
    (["--policy", "swap"], "--policy swap: use recompute, or swap with --lesson l5"),
    (["--requests", "0"], "--requests must be at least 1, got 0"),
    (["--trace", "/no/such/trace.jsonl"], "--trace /no/such/trace.jsonl: [Errno 2]"),
    (["--trace", "{tmp}/words.jsonl"], "words.jsonl: Expecting value"),
    (["--trace", "{tmp}/no_header.jsonl"], "not a pool trace (its first line is no header)"),
    (["--trace", "{tmp}/cut.jsonl"], "not a pool trace this replay can follow (ReplayError: record 1"),
])
def test_the_viewer_refuses_bad_input_in_one_line(argv, says, tmp_path, capsys):
    from test_bad_input import run_script

    (tmp_path / "words.jsonl").write_text("hello\n")
    (tmp_path / "no_header.jsonl").write_text('{"kind": "step"}\n')
    engine = make("l4", 2, 8, 4, 0)
    out = io.StringIO()
    recorder = PoolRecorder(engine, out, "l4")
    drive(engine, [(3, 2, 0, 1, None)], 0)
    recorder.close()
    header, first, *_ = out.getvalue().splitlines()
    cut = json.loads(first)
    cut["events"] = []  # its allocation lost: the table names blocks the pool never handed out
    (tmp_path / "cut.jsonl").write_text(header + "\n" + json.dumps(cut) + "\n")
    code, _, err = run_script("pool_viewer.py", [a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert code == 2 and err.count("\n") == 1 and says in err, err


def test_the_replay_says_what_happened_in_order():
    """The page's "what happened": the plan, then admissions (with their prefix hits), then the step's events."""
    engine = make("l6", 2, 16, 6, 4)
    out = io.StringIO()
    recorder = PoolRecorder(engine, out, "test")
    drive(engine, [(6, 5, 3, 1, None), (5, 5, 0, 2, None)], 4)  # 11 tokens: the fork shares a part-filled block
    recorder.close()
    words = [w for _, _, said in replay([json.loads(line) for line in out.getvalue().splitlines()]) for w in said]
    text = "\n".join(words)
    hit = next(i for i, w in enumerate(words) if "admitted with a prefix-cache hit" in w)
    fork = next(i for i, w in enumerate(words) if "forks request(s)" in w)
    assert hit < fork and "request 1 admitted with a prefix-cache hit: 6 tokens (3 blocks)" in words[hit], text
    assert "copy-on-write: shared block" in text and "finished: 5 tokens generated" in text


def test_the_page_is_self_contained():
    """Opened from disk with no network: the page's template names no address, loads no script or style from
    anywhere, and holds its data mark once (shared/pool_page.py puts the trace's frames there)."""
    import re

    from shared.pool_page import DATA_MARK, TEMPLATE, page_data, render

    html = TEMPLATE.read_text()
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/|\bsrc\s*=|@import|url\(", html, re.I)
    assert html.count(DATA_MARK) == 1
    engine = make("l4", 2, 8, 4, 0)
    out = io.StringIO()
    recorder = PoolRecorder(engine, out, "l4")
    drive(engine, [(3, 2, 0, 1, None)], 0)
    recorder.close()
    page = render(page_data([json.loads(line) for line in out.getvalue().splitlines()], pieces={5: "</script>"}))
    assert page.count("</script>") == html.count("</script>")  # a token's text cannot end the data's script

"""scripts/benchmark/l9_responsiveness.py: its options, its hostile bodies, the before tree's worktree, and one
short run's report against a live server. No timing is asserted: only that every measure is there."""
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import harness  # noqa: E402
import l9_responsiveness as bench  # noqa: E402

from lessons.l9_server.app import MAX_BODY_BYTES  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--clients", "0"], "--clients must be at least 1, got 0"),
    (["--duration", "0"], "--duration must be positive, got 0.0"),
    (["--probe-interval", "nan"], "--probe-interval must be positive, got nan"),
    (["--hostile-interval", "-1"], "--hostile-interval must be positive, or 0 for none, got -1.0"),
    (["--before", "no-such-ref-27"], "--before 'no-such-ref-27': not a commit of this repository"),
])
def test_a_bad_option_is_one_line_and_exit_2(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["l9_responsiveness.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and message in err and len(err.splitlines()) == 1


def test_hostile_bodies_are_just_under_the_limit_or_deep():
    bodies = dict(bench.hostile_bodies("m", MAX_BODY_BYTES, 4096))
    for kind in ("1 MiB text prompt", "1 MiB token-ID prompt"):
        assert MAX_BODY_BYTES - 1024 < len(bodies[kind]) <= MAX_BODY_BYTES
        assert json.loads(bodies[kind])["model"] == "m"
    admitted = json.loads(bodies["tokenized, then too long"])["prompt"]
    assert 4095 * 128 - 8 <= len(admitted) <= 4095 * 128 and len(admitted.split()) > 4096
    assert bodies[f"{bench.NESTING}-deep JSON"].count(b"[") == bench.NESTING == 5000
    bad = json.loads(bodies["bad fields"])
    assert bad["prompt"] == 5 and bad["max_tokens"] == "many"


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_before_tree_is_a_worktree_removed_afterwards():
    with bench.tree("HEAD") as (label, serve):
        assert label.startswith("before: HEAD (") and serve.is_file() and serve != bench.SERVE
    assert not serve.exists()
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(serve.parents[1]) not in listed


@pytest.mark.slow  # the benchmark's own tiny run
def test_a_short_run_reports_every_measure(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["l9_responsiveness.py", "--duration", "1.5", "--clients", "2",
                                      "--hostile-interval", "0.1", "--json", str(out)])
    bench.main()
    printed = capsys.readouterr().out
    assert "L9 under hostile load" in printed and "target (/health p99 <= 20 ms, max <= 100 ms)" in printed
    (label, server), = json.loads(out.read_text())["servers"].items()
    assert label.startswith("after: this tree (") and server["backend"] in ("cpp", "batched (no C++ kernel)")
    # the conditions line names the backend the server itself reported, not a guess
    fields = harness.parse_line(json.loads(out.read_text())["conditions_line"])
    assert fields["backend"] == server["backend"] and fields["threads"] == "1" and "workload" in fields
    summary = server["summary"]
    assert set(summary) == set(bench.summary(bench.Measured(duration_s=1.0, probe_ms=[1.0])))
    assert summary["probes"] == len(server["probe_ms"]) >= 1  # the first probe is always sent
    assert summary["hostile requests"] == sum(sum(c.values()) for c in server["hostile"].values()) >= 1
    assert set(server["hostile"]) <= set(dict(bench.hostile_bodies("m", MAX_BODY_BYTES, 4096)))
    assert summary["tokens/s"] == pytest.approx(server["text_chunks"] / server["duration_s"])


def delay_the_probe(monkeypatch, seconds: float) -> None:
    """health_probe.py starts `seconds` late, as on a box slower than this one: `sleep` runs in front of it."""
    real = asyncio.create_subprocess_exec

    async def late(program: str, *args: str, **kwargs) -> asyncio.subprocess.Process:
        if str(bench.PROBE) in args:  # the probe alone
            return await real("sh", "-c", f'sleep {seconds}; exec "$@"', "sh", program, *args, **kwargs)
        return await real(program, *args, **kwargs)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", late)


@pytest.mark.slow  # the benchmark's own tiny run, with a probe that starts 4 s late
def test_a_probe_that_starts_late_still_probes_before_the_load_ends(tmp_path, monkeypatch, capsys):
    # Past the old fixed 1.5 s head start plus the whole window: the load must wait for the probe's first answer.
    delay_the_probe(monkeypatch, 4)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["l9_responsiveness.py", "--duration", "0.5", "--clients", "1",
                                      "--hostile-interval", "0", "--json", str(out)])
    bench.main()
    (server,) = json.loads(out.read_text())["servers"].values()
    assert server["summary"]["probes"] == len(server["probe_ms"]) >= 1 and server["probe_failures"] == 0


def test_a_probe_never_ready_stops_the_run_with_one_line(monkeypatch):
    delay_the_probe(monkeypatch, 3)
    monkeypatch.setattr(bench, "PROBE_READY_S", 0.3)  # bounded: nothing waits for a stuck probe
    with pytest.raises(RuntimeError, match=r"^the /health probe was not ready within 0.3 s$"):
        asyncio.run(bench.start_probe("http://127.0.0.1:9", 0.01, 1.0))


def test_a_probe_whose_first_get_fails_says_why_in_one_line():
    with pytest.raises(RuntimeError) as e:  # port 9 (discard): nothing listens there
        asyncio.run(bench.start_probe("http://127.0.0.1:9", 0.01, 1.0))
    assert str(e.value) == ("the /health probe was not ready: "
                            "error: the first GET http://127.0.0.1:9/health got ConnectError")

"""`bench.py --plot DIR` writes its PNGs: a tiny run (4 requests, 2-4 new tokens) of one HF baseline and L4 / L5,
so every chart has data. Skipped when matplotlib is not installed (it is a dev extra, not a course dependency)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "benchmark"))

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the benchmark's own tiny run
def test_plot_writes_nonempty_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    cmd = [sys.executable, "scripts/bench.py", "--model", "tiny", "--systems", "hf-static,l4,l5", "--requests", "4",
           "--prompt-len", "8", "24", "--new-tokens", "2", "4", "--kv-budget", "0", "--threads", "1",
           "--device", "cpu", "--out", str(tmp_path / "bench.json"), "--plot", str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pngs = {p.name: p.stat().st_size for p in out.glob("*.png")}
    assert set(pngs) == {"throughput.png", "kv_util.png", "pool_tiny.png"}
    assert all(size > 1000 for size in pngs.values()), pngs
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["conditions"]["threads"] == 1 and "load_after" in report["conditions"]
    # the harness's conditions line, with the backend the course's engines really used (not "auto")
    assert report["conditions_line"] in done.stdout.replace("\n", "")
    assert report["conditions"]["backend"] not in ("auto", "unknown", "none")
    l4 = next(r for r in report["models"][0]["results"] if r["system"].startswith("L4"))
    assert l4["timeline"] and l4["roofline_share"] > 0


# Every system name bench.py reports, in its order (scripts/benchmark/bench_systems.py).
SYSTEM_NAMES = ["HF generate, one at a time (16 requests)", "HF generate, static batches of 8",
                "HF generate_batch (continuous)", "L3 static batches of 8", "L4 continuous",
                "L5 preemption (recompute)", "L6 prefix sharing"]


def test_every_system_gets_its_own_bar():
    """L3's name contains 'static batches' too: it once took HF static's label, and HF static's bar vanished."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from bench_plots import grouped_bars, short

    labels = [short(n) for n in SYSTEM_NAMES]
    assert labels == ["HF single", "HF static", "HF cb", "L3", "L4", "L5", "L6"]
    model = {"model": "tiny", "results": [{"system": n, "x_best_hf": 1.0 + i} for i, n in enumerate(SYSTEM_NAMES)]}
    fig, ax = plt.subplots()
    grouped_bars(ax, [model], [("", lambda r: r.get("x_best_hf"))], labels)
    assert sorted(bar.get_height() for bar in ax.patches) == [1.0 + i for i in range(len(SYSTEM_NAMES))]
    plt.close(fig)

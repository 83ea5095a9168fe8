"""PNG pictures of one benchmark report (`bench.py --plot DIR`): throughput against the best HF baseline,
KV utilization of the paged systems, and the pool over time under L4 and L5.

Reads only the report dict bench.py writes as JSON (with its conditions, which every picture prints under
the plot via harness.save_png), so the same pictures can be redrawn from a saved run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from harness import Conditions, figure, save_png
from matplotlib.ticker import MaxNLocator

PAGED = ("L3", "L4", "L5", "L6")


def short(system: str) -> str:
    """'HF generate, static batches of 8' -> 'HF static', 'L3 static batches of 8' -> 'L3': bar labels must
    fit under a bar, and must stay distinct (one bar per label and model)."""
    if system.startswith("HF"):
        for long, name in (("one at a time", "HF single"), ("static batches", "HF static"), ("generate_batch", "HF cb")):
            if long in system:
                return name
    return system.split()[0]


def ok(model: dict) -> list[dict]:
    return [r for r in model["results"] if not r.get("error")]


Value = Callable[[dict], "float | None"]  # reads one number out of a system's result row


def grouped_bars(ax, models: list[dict], series: list[tuple[str, Value]], systems: list[str]) -> None:
    """One group per model, one bar per (system, series) inside it."""
    width, labelled = 0.8 / max(1, len(systems) * len(series)), set()
    for g, model in enumerate(models):
        by = {short(r["system"]): r for r in ok(model)}
        for s, system in enumerate(systems):
            for j, (label, value) in enumerate(series):
                if system in by and value(by[system]) is not None:
                    x = g + (s * len(series) + j) * width - 0.4 + width / 2
                    name = f"{system} {label}".strip()
                    ax.bar(x, value(by[system]), width, color=f"C{s}", alpha=1.0 - 0.45 * j,
                           label=None if name in labelled else name)  # one legend entry per kind of bar
                    labelled.add(name)
    ax.set_xticks(range(len(models)), [m["model"] for m in models])


def throughput(report: dict, out: Path, conditions: Conditions) -> Path:
    models = report["models"]
    systems = list(dict.fromkeys(short(r["system"]) for m in models for r in ok(m)))
    fig, (left, right) = figure(1, 2, figsize=(12, 4.5))
    grouped_bars(left, models, [("", lambda r: r.get("x_best_hf"))], systems)
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    left.set_ylabel("output tokens/s ÷ best HF baseline")
    left.set_title("Throughput (same invocation)")
    left.legend(fontsize=8)
    grouped_bars(right, models, [("", lambda r: r.get("roofline_share"))], systems)
    right.set_ylabel("roofline seconds ÷ measured seconds")
    right.set_title("Share of this machine's matmul roofline")
    path = out / "throughput.png"
    fig.tight_layout()
    return save_png(fig, path, conditions)


def kv_util(report: dict, out: Path, conditions: Conditions) -> Path:
    models = report["models"]
    systems = [s for s in PAGED if any(short(r["system"]) == s for m in models for r in ok(m))]
    fig, ax = figure(figsize=(8, 4.5))
    grouped_bars(ax, models, [("mean", lambda r: r.get("util_mean")), ("peak", lambda r: r.get("util_peak"))], systems)
    ax.set_ylabel("KV tokens held ÷ slots reserved")
    ax.set_title("KV utilization of the paged systems (mean over steps; at the step reserving most)")
    ax.legend(fontsize=8, ncol=2)
    path = out / "kv_util.png"
    fig.tight_layout()
    return save_png(fig, path, conditions)


def pool(model: dict, num_blocks: int, out: Path, conditions: Conditions) -> Path | None:
    """Blocks each request holds at every step, stacked: the gaps above the stack are free blocks."""
    runs = [r for r in ok(model) if short(r["system"]) in ("L4", "L5") and r.get("timeline")]
    if not runs:
        return None
    fig, axes = figure(len(runs), 1, figsize=(10, 3.2 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        timeline = [{int(k): v for k, v in step.items()} for step in r["timeline"]]  # JSON keys are strings
        ids = sorted({i for step in timeline for i in step})
        ax.stackplot(range(1, len(timeline) + 1), [[step.get(i, 0) for step in timeline] for i in ids],
                     colors=[f"C{i % 10}" for i in ids], linewidth=0)
        ax.axhline(num_blocks, color="black", lw=0.8, ls="--", label=f"pool: {num_blocks} blocks")
        ax.set_title(f"{model['model']}: {r['system']}, {r.get('preemptions') or 0} preemption(s)")
        ax.set_ylabel("blocks held")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("engine step")
    path = out / f"pool_{Path(model['model']).name}.png"
    fig.tight_layout()
    return save_png(fig, path, conditions)


def draw_all(report: dict, out_dir: str, num_blocks: int, conditions: Conditions) -> list[Path]:
    out = Path(out_dir)
    paths = [throughput(report, out, conditions), kv_util(report, out, conditions)]
    paths += [p for m in report["models"] if (p := pool(m, num_blocks, out, conditions))]
    return paths

"""L6's worked example on the real engine: three requests sharing an 8-token system prompt, S = 4, 10 blocks.

    python scripts/l6_walkthrough.py                                   # the pool after every step, one step's metadata
    python scripts/l6_walkthrough.py --plot docs/figures/l6_walkthrough.png
    python scripts/l6_walkthrough.py --model smollm2                   # the same schedule on a trained model

A arrives at step 0, B at 1, C at 2 (the engine clock when each is submitted); each engine step first
advances the clock, so a request submitted at clock t is first scheduled in the step printed as t + 1.
The table is what docs/l6_prefix_sharing.md shows, and the doc's test reruns this script.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lessons.l3_block_tensor.batch_meta import BatchMeta  # noqa: E402
from lessons.l6_prefix_sharing import L6Engine  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.pool_trace import record_engines  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

S, BLOCKS = 4, 10
# 8 tokens: two full blocks. Only the ids' count and sharing matter here (nothing prints what the model says), so
# the same ids serve any model: every vocabulary has them.
SYSTEM = list(range(11, 19))
REQUESTS = [  # name, prompt, submitted at clock, new tokens
    ("A", SYSTEM + [21, 22], 0, 3),
    ("B", SYSTEM + [31, 32, 33], 1, 2),
    ("C", SYSTEM, 2, 2),
]
META_STEP = 2  # the step whose metadata is printed: A decodes while B prefills its 3 own tokens


@dataclass
class Snapshot:
    step: int
    tables: dict[str, list[int]]  # running requests' block tables after the step
    ref: dict[int, int]  # held blocks' reference counts
    lru: list[int]  # cached and unreferenced, least recently released first
    free: list[int]  # never used or evicted, in hand-out order
    hits: int  # prompt tokens served from the cache so far
    cached: set[int]  # blocks the prefix cache names


def spans(blocks: list[int]) -> str:
    """[3, 4, 5, 9, 1] -> '3..5, 9, 1': runs of consecutive ids, in order."""
    out, i = [], 0
    while i < len(blocks):
        j = i
        while j + 1 < len(blocks) and blocks[j + 1] == blocks[j] + 1:
            j += 1
        out.append(f"{blocks[i]}..{blocks[j]}" if j - i >= 2 else ", ".join(map(str, blocks[i:j + 1])))
        i = j + 1
    return ", ".join(out) or "-"


def run(model_dir: Path) -> tuple[list[Snapshot], dict[str, torch.Tensor], list[str]]:
    model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
    engine = L6Engine(model, S, BLOCKS, backend="torch")
    names: dict[int, str] = {}
    metas: dict[int, BatchMeta] = {}
    order: list[str] = []
    forward = engine.runner.forward

    def recording_forward(batch):
        metas[engine.clock] = BatchMeta.build(batch, S, torch.device("cpu"))
        if engine.clock == META_STEP:
            order.extend(names[s.seq_id] for s in batch)
        return forward(batch)

    engine.runner.forward = recording_forward
    snapshots, pending = [], list(REQUESTS)
    while pending or engine.scheduler.has_work():
        for name, prompt, at, new in [r for r in pending if r[2] <= engine.clock]:
            seq = engine.add_request(prompt, StopRule(new, frozenset(), ignore_eos=True))
            names[seq.seq_id] = name
            pending.remove((name, prompt, at, new))
        engine.step()
        m = engine.allocator
        snapshots.append(Snapshot(
            engine.clock, {names[s.seq_id]: list(s.blocks) for s in engine.scheduler.running},
            {b: r for b, r in enumerate(m.ref) if r}, list(m._lru), list(m._free), engine.stats.cached_tokens,
            set(engine.cache.entry)))
    return snapshots, metas[META_STEP], order


def print_table(snapshots: list[Snapshot]) -> None:
    print(f"{'step':>4}  {'tables':<24}{'ref (held)':<19}{'cached-unreferenced (LRU)':<27}{'free':<19}cache hits")
    for s in snapshots:
        tables = " ".join(f"{n}:[{','.join(map(str, b))}]" for n, b in s.tables.items()) or "-"
        ref = " ".join(f"{b}:{r}" for b, r in s.ref.items()) or "-"
        lru = f"[{', '.join(map(str, s.lru))}]" if s.lru else "-"
        print(f"{s.step:>4}  {tables:<24}{ref:<19}{lru:<27}{spans(s.free):<19}{s.hits}")


def print_meta(meta: BatchMeta, order: list[str]) -> None:
    print(f"step {META_STEP}, batch {order} (running requests first, then admissions):")
    for field in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "positions", "slot_mapping", "last_rows"):
        print(f"  {field:<17}{getattr(meta, field).tolist()}")


def plot(snapshots: list[Snapshot], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = {"A": "#4c72b0", "B": "#dd8452", "C": "#55a868"}
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.7 * len(snapshots)))
    for row, s in enumerate(snapshots):
        y = len(snapshots) - 1 - row
        owners: dict[int, list[str]] = {}
        for name, blocks in s.tables.items():
            for b in blocks:
                owners.setdefault(b, []).append(name)
        for b in range(BLOCKS):
            if b in owners:
                who = owners[b]
                face, label = colours[who[0]] if len(who) == 1 else "#8172b3", "+".join(who)
                label += f"\nref {s.ref[b]}"
            elif b in s.lru:
                face, label = "#c8c8c8", f"cached\nLRU {s.lru.index(b) + 1}"
            else:
                face, label = "white", "free"
            hatch = "//" if b in s.cached and b in owners else None
            ax.add_patch(plt.Rectangle((b, y), 0.94, 0.9, facecolor=face, edgecolor="black", hatch=hatch))
            ax.text(b + 0.47, y + 0.45, label, ha="center", va="center", fontsize=7,
                    color="white" if face not in ("white", "#c8c8c8") else "black")
    ax.set_xlim(0, BLOCKS)
    ax.set_ylim(0, len(snapshots))
    ax.set_xticks([b + 0.47 for b in range(BLOCKS)], [str(b) for b in range(BLOCKS)])
    ax.set_yticks([len(snapshots) - 1 - r + 0.45 for r in range(len(snapshots))],
                  [f"after step {s.step}" for s in snapshots])
    ax.set_xlabel("block id")
    ax.set_title(f"L6 worked example: the pool after each step (S = {S}; hatched: held and named by the prefix cache)")
    ax.legend(handles=[Patch(facecolor=c, label=f"held by {n}") for n, c in colours.items()]
              + [Patch(facecolor="#8172b3", label="shared"), Patch(facecolor="#c8c8c8", label="cached, unreferenced"),
                 Patch(facecolor="white", edgecolor="black", label="free")],
              loc="upper center", bbox_to_anchor=(0.5, -0.22 * 4 / len(snapshots)), ncol=6, fontsize=7, frameon=False)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = OneLineParser(prog="l6_walkthrough.py", description=__doc__.splitlines()[0])
    p.add_argument("--plot", metavar="PNG", help="also draw the pool after every step into this file")
    p.add_argument("--model", help="a checkpoint directory or a named model (smollm2); default: the embedded tiny model")
    p.add_argument("--trace", metavar="FILE", help="write the pool trace (JSON lines) here; "
                                                 "python scripts/pool_viewer.py --trace FILE draws it")
    args = p.parse_args()
    try:
        with record_engines(L6Engine, args.trace, "l6"):
            snapshots, meta, order = run(resolve_model_dir(args.model, default_model_dir))
    except CourseError as e:
        p.error(str(e))
    print_table(snapshots)
    print_meta(meta, order)
    if args.plot:
        plot(snapshots, Path(args.plot))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

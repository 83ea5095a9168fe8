"""Where L4's time goes: one L4 run of the benchmark's mixed workload under cProfile, split by the engine's seams.

    OMP_NUM_THREADS=1 python scripts/benchmark/profile_l4.py --model bench --requests 24

Each row is the cumulative time inside one function (all its calls), as a share of the whole run; rows
nest (the model's forward contains the layer matmuls and the attention), so only siblings add up.
cProfile adds its own cost to every Python call, so Python-heavy rows read a little high. Not a test.

`--matmul-floor` then times the model's own layer matmuls, all of them in the order a step runs them, with its
real weights, at the roofline's token buckets (1, 4, ... 1,024 rows), beside what scripts/benchmark/roofline.py
charges for the same matmuls: it times each shape with one weight called again and again, which then comes
from the cache, while a step reads each weight once, the whole model passing through the cache in between.
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's lessons/ and shared/, not an installed course's
import bench_systems as bs  # noqa: E402
import harness  # noqa: E402
from bench_systems import bench_shape_dir  # noqa: E402
from roofline import Rates, best_seconds, linear_shapes  # noqa: E402
from lessons.l4_continuous import L4Engine  # noqa: E402
from shared.cli import OneLineParser, resolve_dtype, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

# (key, file name ending, function name); file "~" is a C function, matched by a name fragment.
SEAMS = {
    "step": ("l4_continuous/engine.py", "step"),
    "schedule": ("l4_continuous/scheduler.py", "schedule"),
    "postprocess": ("l4_continuous/scheduler.py", "postprocess"),
    "meta": ("l3_block_tensor/batch_meta.py", "build"),
    "forward": ("shared/model.py", "forward"),
    "linear": ("shared/layers.py", "linear"),  # every projection: the C++ few-row matmul or torch's F.linear
    "write": ("l3_block_tensor/kv_pool.py", "write"),
    "run": ("backends/", "run"),
    "sdpa": ("~", "scaled_dot_product_attention"),
    "plan": ("backends/", "plan"),
    "logits": ("shared/model.py", "logits"),
    "sample": ("l4_continuous/sampling.py", "sample"),
}


def rows(t: dict[str, float]) -> list[tuple[str, float]]:
    """The table, indented by nesting. The vocab projection's matmul runs in model.logits, outside the forward."""
    layer_matmuls = t["linear"] - t["logits"]
    rest = t["forward"] - layer_matmuls - t["run"] - t["write"]
    return [
        ("engine step (everything below)", t["step"]),
        ("  scheduler: schedule + postprocess", t["schedule"] + t["postprocess"]),
        ("  batch metadata (BatchMeta.build)", t["meta"]),
        ("  model forward (every layer)", t["forward"]),
        ("    layer matmuls (shared.layers.linear)", layer_matmuls),
        ("    attention backend: run", t["run"]),
        ("      of which scaled_dot_product_attention", t["sdpa"]),
        ("    KV pool write", t["write"]),
        ("    the rest: norms, RoPE, SiLU, adds, Python", rest),
        ("  attention backend: plan", t["plan"]),
        ("  vocab projection (model.logits)", t["logits"]),
        ("  sampling", t["sample"]),
    ]


def cumulative(stats: pstats.Stats, file_end: str, name: str) -> float:
    """Cumulative seconds in a function. Several Python matches (the model's nested `forward`s) are nested
    calls, so the outermost, the largest, holds the rest; C functions matching the fragment are summed."""
    found = [ct for (file, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.stats.items()  # type: ignore[attr-defined]
             if (file == "~" and file_end == "~" and name in func)
             or (file != "~" and file_end in file.replace("\\", "/") and func == name)]
    return sum(found) if file_end == "~" else max(found, default=0.0)


def matmul_floor(model: Qwen3ForCausalLM, rows: list[int]) -> Table:
    """Per row count: the roofline's seconds for one step's layer matmuls against the model's own, timed in order."""
    cfg, weight = model.config, model.lm_head.weight
    rates = Rates(cfg, weight.dtype, weight.device)
    weights = [proj.weight for layer in model.model.layers for proj in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    mib = sum(w.numel() * w.element_size() for w in weights) / 2**20
    cells = []
    for m in rows:
        x = {k: torch.randn(m, k, dtype=weight.dtype) for k in {w.shape[1] for w in weights}}  # by in-features
        shapes = linear_shapes(cfg).values()
        roof = cfg.num_hidden_layers * sum(2 * m * k * n / rates.linear(m, k, n) for k, n in shapes)
        own = best_seconds(lambda: [F.linear(x[w.shape[1]], w) for w in weights], budget_s=0.2)
        cells.append([str(m), f"{roof * 1e3:.2f}", f"{own * 1e3:.2f}", f"{own / roof:.2f}x"])
    return harness.table(f"layer matmuls of one forward ({len(weights)} weights, {mib:.0f} MiB): the roofline's "
                         "rate against the model's own weights in order",
                         ("rows", "roofline ms", "model's own ms", "own / roofline"), cells)


def parser() -> OneLineParser:
    p = OneLineParser(prog="profile_l4.py", description=__doc__)
    p.add_argument("--model", default="bench",
                   help="tiny (embedded), bench (the bench shape), a named model such as smollm2, or a directory")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--matmul-floor", action="store_true",
                   help="also time the model's own layer matmuls against the roofline's rate (see above)")
    return p


def main() -> None:
    args = parser().parse_args()
    try:
        if args.requests < 1 or args.threads < 1:
            raise CourseError(f"--requests {args.requests} / --threads {args.threads}: both must be at least 1")
        torch.set_num_threads(args.threads)
        dtype = resolve_dtype(args.dtype, torch.device("cpu"))
        shapes = {"tiny": default_model_dir, "bench": bench_shape_dir}
        path = shapes[args.model]() if args.model in shapes else resolve_model_dir(args.model, default_model_dir)
        model = Qwen3ForCausalLM.from_dir(path, dtype, torch.device("cpu"))
        jobs = bs.make_workload(args.requests, (32, 512), (16, 128), model.config.vocab_size, args.seed)
        engine = L4Engine(model, 16, 512, 64, args.backend)
        conditions = harness.start("cpu", dtype, backend=harness.backend_name(engine), threads=args.threads)
        conditions.extra["model"] = args.model
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)

    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for j in jobs:
        engine.add_request(j.prompt_ids, bs.stop_for(j))
    while engine.scheduler.has_work():
        engine.step()
    profiler.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(profiler)

    console = Console()
    seconds = {key: cumulative(stats, file_end, name) for key, (file_end, name) in SEAMS.items()}
    console.print(harness.table(
        f"L4 on {args.model}, {args.requests} requests, {args.dtype}, {args.threads} thread(s), backend "
        f"{conditions.backend}: {wall:.2f} s under cProfile", ("where", "seconds", "share"),
        [[label, f"{s:.2f}", f"{100 * s / wall:.0f}%"] for label, s in rows(seconds)]))
    if args.matmul_floor:
        console.print(matmul_floor(model, [1, 4, 16, 64, 256, 1024]))
    harness.finish(conditions, console)


if __name__ == "__main__":
    main()

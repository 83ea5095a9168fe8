"""L10 smoke: tensor parallelism. The model is split across --tp ranks (gloo on CPU, NCCL on CUDA): each rank
holds its share of the heads, the MLP and the vocabulary, and its heads' slice of every KV block. Rank 0 runs
L8's scheduler on L9's engine and sends each step to the others. The workload has it all: four short requests
decode while a long prompt arrives and is cut into slices, and a later prompt shares most of the long one (a
prefix hit). Every request's greedy tokens must equal HF's for that prompt alone, and L8's on one rank.

    python scripts/l10_smoke.py --tp 2                          # rank 1 is spawned from here
    torchrun --nproc-per-node 2 scripts/l10_smoke.py --tp 2     # or started by torchrun (one machine or many)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING, Arrival  # noqa: E402
from lessons.l8_chunked_prefill import L8Engine  # noqa: E402
from lessons.l8_chunked_prefill.scheduler import DEFAULT_MAX_BATCHED_TOKENS  # noqa: E402
from lessons.l10_tensor_parallel import L10Engine  # noqa: E402
from lessons.l10_tensor_parallel.group import DEFAULT_TIMEOUT_S  # noqa: E402
from lessons.l10_tensor_parallel.launch import follow_if_torchrun, start  # noqa: E402
from lessons.l10_tensor_parallel.layout import check_tp  # noqa: E402
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM  # noqa: E402
from l8_smoke import LONG, SHORT  # noqa: E402  (scripts/ is on the path when a smoke runs)
from shared.cli import resolve_model_dir, smoke_parser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.smoke import main  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

SEQUEL = LONG.removesuffix("Tell me what happens next:") + "Who waves the ferry in?"  # the long prompt's prefix
DEFAULT_PROMPTS = [*SHORT, LONG, "1, 2, 3, 4,", SEQUEL]


def arrival_step(i: int) -> int:
    """Short ones at once; the long one (and the count) at step 4; the sequel at 16, once the long prompt's
    blocks are in the prefix cache."""
    return 0 if i < len(SHORT) else 4 if i < len(SHORT) + 2 else 16


def parser():
    p = smoke_parser("L10", __doc__.split("\n\n")[0], blocks=True, default_prompts=DEFAULT_PROMPTS)
    p.add_argument("--tp", type=int,
                   help="ranks the model is split across (default: 2, or the smallest split above 2 that the model's "
                        "heads allow: 3 for SmolLM2's 9 query and 3 key/value heads)")
    p.add_argument("--tp-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds a rank waits in a collective before the run fails (default: {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--max-batched-tokens", type=int, default=DEFAULT_MAX_BATCHED_TOKENS,
                   help=f"the token budget of one step (default: {DEFAULT_MAX_BATCHED_TOKENS})")
    p.add_argument("--max-slice-tokens", type=int, help="most prompt tokens one request computes in a step")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="most requests in one step")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="off: every step eager")
    return p


def default_tp(cfg) -> int:
    """2 ranks where the model splits two ways, else the fewest above 2 that it splits into: a model named with
    --model alone (SmolLM2: 9 query heads, 3 KV heads) runs split, not an error about a --tp nobody gave."""
    for tp in range(2, cfg.num_attention_heads + 1):
        try:
            check_tp(cfg, tp)
            return tp
        except CourseError:
            continue
    return 1  # a model no split divides: one rank, its collectives skipped (the report says "no collectives")


def build_engines(model, args):
    def engine(cls, m):
        return cls(m, args.block_size, args.num_blocks, args.max_running, args.backend, graphs=args.graphs == "on",
                   max_batched_tokens=args.max_batched_tokens, max_slice_tokens=args.max_slice_tokens)

    def workload(prompts, stop):
        return [Arrival(p, stop, step=arrival_step(i)) for i, p in enumerate(prompts)]

    def l10(prompts, stop):
        try:
            return args.l10.run(workload(prompts, stop))
        finally:
            args.l10.close()  # the followers stop now: the single-rank and HF runs get the CPU to themselves

    def l8(prompts, stop):
        args.l8 = engine(L8Engine, model)
        return args.l8.run(workload(prompts, stop))

    if args.tp is None:
        args.tp = default_tp(model.config)
    check_tp(model.config, args.tp)  # before any rank starts
    engine(L8Engine, model)  # bad engine options fail here, on one rank
    group = start(args.tp, model.lm_head.weight.device, args.tp_timeout)
    tp_model = TpQwen3ForCausalLM.load(resolve_model_dir(args.model, default_model_dir), model.lm_head.weight.dtype,
                                       group)
    args.l10 = engine(L10Engine, tp_model)
    return {"L10": l10, "L8": l8}


def tp_report(model, setup, args):
    eng, group, layout = args.l10, args.l10.model.tp, args.l10.model.layout
    cfg = model.config
    hits = eng.stats.cached_tokens
    slices = max(eng.prompt_slices.values(), default=0)
    leak = eng.allocator.num_free != eng.usable_blocks
    steps = len(eng.step_tokens)
    reduces = group.calls["all-reduce"]
    per_step = 2 * cfg.num_hidden_layers + 1  # o_proj and down_proj in every layer, and the embedding
    pool, whole = eng.runner.pool.bytes(), args.l8.runner.pool.bytes()
    ok = not leak and (args.tp == 1 or reduces == per_step * (steps + len(eng.runner.captures)))
    if args.prompt is None:
        ok = ok and hits > 0 and slices > 1  # the default workload must exercise prefix hits and chunking
    def span(r: range) -> str:
        return f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"

    backend = "no collectives" if args.tp == 1 else "nccl" if group.device.type == "cuda" else "gloo"
    line = (f"L10 on {args.tp} rank(s) ({backend}): rank 0 holds query heads "
            f"{span(layout.q_heads)} of {cfg.num_attention_heads}, KV head(s) {span(layout.kv_heads)} of {cfg.num_key_value_heads}"
            f"{' (replicated)' if args.tp > cfg.num_key_value_heads else ''}, {len(layout.mlp)} of "
            f"{cfg.intermediate_size} MLP rows, {len(layout.vocab)} of {cfg.vocab_size} token ids; KV pool "
            f"{pool / 2**20:.2f} MiB per rank vs {whole / 2**20:.2f} MiB on one\n"
            f"  {steps} steps + {len(eng.runner.captures)} captures, {reduces} all-reduces on rank 0 "
            f"({per_step} per forward: 2 per layer + the embedding); {hits} prompt tokens from the prefix cache; "
            f"longest prompt in {slices} slices; {eng.allocator.num_free} of {eng.usable_blocks} usable blocks free "
            f"or cached at the end{' (LEAK)' if leak else ''}\n"
            f"  rank 0 spent {group.seconds['all-reduce'] * 1e3:.1f} ms in all-reduces and "
            f"{group.seconds['gather'] * 1e3:.1f} ms gathering logits")
    return ok, line


if __name__ == "__main__":
    follow_if_torchrun()  # under torchrun, ranks above 0 follow rank 0 and never get here
    main("L10", parser(), build_engines, tp_report)

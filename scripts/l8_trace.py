"""L8's worked example on the real engine: what each step computes, and the metadata it plans.

    python scripts/l8_trace.py [--max-batched-tokens 8]

Block size 4, budget 8 tokens per step, graphs off (every step plans the metadata printed). A (6 tokens) and
B (5) are submitted at clock 0, C (14) at clock 2; a request submitted at clock t is first scheduled in
step t + 1. Each step lists its slices in batch order (decodes first) and the BatchMeta L3's backends get;
docs/l8_chunked_prefill.md shows this output, and the doc's test reruns the script.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l3_block_tensor.batch_meta import BatchMeta  # noqa: E402
from lessons.l8_chunked_prefill import L8Engine  # noqa: E402
from lessons.l8_chunked_prefill.slice import Slice  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.pool_trace import record_engines  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

S = 4
REQUESTS = [  # name, prompt length, submitted at clock, new tokens
    ("A", 6, 0, 6),
    ("B", 5, 0, 5),
    ("C", 14, 2, 3),
]


def describe(piece: Slice, names: dict[int, str]) -> str:
    first, last = piece.num_cached, piece.num_tokens - 1
    what = "decode" if piece.decode else "prompt"
    where = f"pos {first}" if first == last else f"pos {first}..{last}"
    return f"{names[piece.seq_id]} {what} {where}{' -> samples' if piece.samples else ' (no sample)'}"


def ints(t: torch.Tensor) -> str:
    return "[" + " ".join(str(int(x)) for x in t) + "]"


def main() -> None:
    p = OneLineParser(prog="l8_trace.py", description=__doc__.splitlines()[0])
    p.add_argument("--max-batched-tokens", type=int, default=8, help="the token budget of one step (default: 8)")
    p.add_argument("--model", help="a checkpoint directory or a named model such as smollm2 (default: embedded)")
    p.add_argument("--trace", metavar="FILE", help="write the pool trace (JSON lines) here; "
                                                 "python scripts/pool_viewer.py --trace FILE draws it")
    args = p.parse_args()
    try:
        with record_engines(L8Engine, args.trace, "l8"):
            run(args.max_batched_tokens, resolve_model_dir(args.model, default_model_dir))
    except CourseError as e:
        p.error(str(e))


def run(budget: int, model_dir: Path) -> None:
    model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
    engine = L8Engine(model, S, 32, graphs=False, max_batched_tokens=budget)
    names: dict[int, str] = {}
    schedule = engine.scheduler.schedule

    def traced() -> list[Slice]:
        plan = schedule()
        if plan:
            meta = BatchMeta.build(plan, S, torch.device("cpu"))  # what the runner builds from these slices
            print(f"step {engine.clock}: " + " | ".join(describe(piece, names) for piece in plan)
                  + f"  ({sum(piece.num_tokens - piece.num_cached for piece in plan)} of {budget} tokens)")
            print(f"  qo_indptr {ints(meta.qo_indptr)}  kv_indptr {ints(meta.kv_indptr)}  kv_indices "
                  f"{ints(meta.kv_indices)}  kv_last_page_len {ints(meta.kv_last_page_len)}")
        return plan

    engine.scheduler.schedule = traced
    pending = sorted(REQUESTS, key=lambda r: r[2])
    while pending or engine.scheduler.has_work():
        while pending and pending[0][2] <= engine.clock:
            name, length, _, new = pending.pop(0)
            prompt = [100 + 7 * len(names) + i for i in range(length)]
            seq = engine.add_request(prompt, StopRule(new, frozenset(), ignore_eos=True))
            names[seq.seq_id] = name
        engine.step()
    for sid, name in names.items():
        t = engine.timing[sid]
        print(f"{name}: first token after {t.ttft_steps} step(s), then gaps of {t.gap_steps} step(s); "
              f"prompt in {engine.prompt_slices.get(sid, 0)} slice(s)")


if __name__ == "__main__":
    main()

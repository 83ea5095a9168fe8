"""L14's worked example: one request's decode row, alone and among other requests, traced op by op to the first
op whose output for that row differs, and the first differing bit.

    python scripts/l14_walkthrough.py [--crowd N] [--model smollm2]

A prompt is prefilled and decoded through L14Engine (graphs off, so a step computes exactly its rows), once alone
and once beside N other requests (default 16) that decode with it. At its third decode step every module's output
row for that request is kept (forward hooks on the model's modules, in the order they run; attention is the
input of each layer's o_proj). The two traces are compared op by op: the default mode, then the batch-invariant
mode. docs/l14_batch_invariant.md shows this output, and the doc's test reruns it.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lessons.l14_batch_invariant import L14Engine  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.pool_trace import record_engines  # noqa: E402
from shared.smoke import exit_with  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

PROMPT = "The capital of France is"
TRACED_STEP = 2  # the decode that chooses output index 2: the request has decoded twice before, alone or not


def parser() -> OneLineParser:
    p = OneLineParser(prog="l14_walkthrough.py", description=__doc__.splitlines()[0])
    p.add_argument("--crowd", type=int, default=16, help="other requests decoding beside it (default: 16: 17 rows, past "
                   "the few-row matmul's 16, so the default mode's matmuls are torch's in the crowd)")
    p.add_argument("--model", help="a checkpoint directory or a named model (smollm2); default: the embedded model")
    p.add_argument("--trace", metavar="FILE", help="write the pool trace (JSON lines) here; "
                                                 "python scripts/pool_viewer.py --trace FILE draws it")
    return p


def trace(model: Qwen3ForCausalLM, invariant: bool, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """{op name: the traced request's row of its output} at the decode choosing its output TRACED_STEP. The traced
    request is prompts[0]; every request decodes at once (all prefilled in the first step)."""
    engine = L14Engine(model, 16, graphs=False, batch_invariant=invariant, max_batched_tokens=4096)
    seqs = [engine.add_request(p, StopRule(TRACED_STEP + 1, ignore_eos=True)) for p in prompts]
    while len(seqs[0].output_ids) < TRACED_STEP:
        engine.step()
    rows: dict[str, torch.Tensor] = {}
    order = {id(s): i for i, s in enumerate(engine.scheduler.running)}  # a decode step's rows: the running order
    row = order[id(seqs[0])]

    def keep(name: str):  # a hook that returned the tensor would replace the module's output: it returns None
        def hook(module, args, out=None) -> None:
            rows.setdefault(name, (args[0] if out is None else out)[row].float().flatten().clone())
        return hook

    hooks = []
    for name, module in engine.model.named_modules():
        if name.endswith("o_proj"):
            hooks.append(module.register_forward_pre_hook(keep(name.removesuffix("o_proj") + "attention")))
        if not list(module.children()) and name != "model.rotary":  # leaves, in the order they run
            hooks.append(module.register_forward_hook(keep(name)))
    runner_forward = engine.runner.forward
    engine.runner.forward = lambda batch: _logits(rows, runner_forward(batch), row)
    engine.step()
    for h in hooks:
        h.remove()
    return rows


def _logits(rows: dict, logits: torch.Tensor, row: int) -> torch.Tensor:
    rows["logits (the LM head, fp32)"] = logits[row].clone()
    return logits


def bits(x: float) -> str:
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08x}"


def compare(alone: dict[str, torch.Tensor], crowd: dict[str, torch.Tensor], n: int) -> None:
    first = next((name for name in alone if not torch.equal(alone[name], crowd[name])), None)
    if first is None:
        print(f"  every one of the {len(alone)} ops gives its row bitwise the same alone and among {n} others")
        return
    a, b = alone[first], crowd[first]
    i = int((a.view(torch.int32) != b.view(torch.int32)).nonzero()[0])
    names = list(alone)
    same = names.index(first)
    later = sum(not torch.equal(alone[k], crowd[k]) for k in names[same + 1:])
    print(f"  the first {same} ops agree bitwise ({', '.join(names[:same])}); the first that differs: {first}")
    print(f"    element {i}: {a[i].item()!r} ({bits(a[i].item())}) alone, {b[i].item()!r} ({bits(b[i].item())}) "
          f"among {n} others: {abs(a[i].item() - b[i].item()):.3g} apart")
    print(f"  of the {len(names) - same - 1} ops after it, {later} differ; the logits row: largest difference "
          f"{(alone[names[-1]] - crowd[names[-1]]).abs().max().item():.3g}")


def run(args) -> int:
    if args.crowd < 1:
        raise CourseError(f"--crowd must be at least 1, got {args.crowd}")
    model_dir = resolve_model_dir(args.model, default_model_dir)
    model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
    prompt = load_tokenizer(model_dir).encode(PROMPT).ids
    others = [[(7 * i + 11 * j) % 5000 + 100 for j in range(3 + i)] for i in range(args.crowd)]
    print(f"prompt {PROMPT!r} ({len(prompt)} tokens), its decode choosing output {TRACED_STEP}: alone (1 row in the "
          f"step) and among {args.crowd} other decoding requests ({args.crowd + 1} rows); one thread, fp32")
    for invariant in (False, True):
        print("default mode (L13's step):" if not invariant else "batch-invariant mode:")
        compare(trace(model, invariant, [prompt]), trace(model, invariant, [prompt, *others]), args.crowd)
    return 0


if __name__ == "__main__":
    args = parser().parse_args()
    with record_engines(L14Engine, args.trace, "l14"):
        exit_with(lambda: run(args))

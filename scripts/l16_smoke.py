"""L16 smoke: weight-only quantization. The model's matrices are GGUF weight blocks (Q8_0, Q4_1) that a decode step
reads as their 8 or 4 bits, dequantizing in registers and summing in the fp32 path's order. On SmolLM2's shipped
Q4_1 file the logits at every output position must be bitwise the fp32 dequantized model's, and the greedy tokens
HF's. On a model quantized here from full precision (the embedded one) exact tokens are not the test: the logits
must still be bitwise the dequantized model's, and the quality contract is measured teacher-forced, L12's way.

    python scripts/l16_smoke.py                       # the embedded model quantized to Q8_0 and Q4_1: the contract
    python scripts/l16_smoke.py --model smollm2       # the shipped Q4_1 file: bitwise the fp32 model, HF's tokens
    python scripts/l16_smoke.py --weights q8_0        # one format
    python scripts/l16_smoke.py --weights fp32        # L15's engine on the checkpoint: HF parity
    python scripts/l16_smoke.py --weights q4_1 --parity  # HF on the dequantized weights: its tokens, bitwise logits
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402

from lessons.l2_token_flat.engine import blocks_for  # noqa: E402
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l3_block_tensor.runner import PagedRunner  # noqa: E402
from lessons.l12_kv_quant.quality import Judgement, Quality, compare, judge  # noqa: E402
from lessons.l14_batch_invariant.record import first_difference, run_recorded  # noqa: E402
from lessons.l15_disaggregated import L15Engine  # noqa: E402
from lessons.l16_weight_quant import L16Engine  # noqa: E402
from lessons.l16_weight_quant.llamacpp_way import llamacpp_way  # noqa: E402
from lessons.l16_weight_quant.reference import dequantized_checkpoint  # noqa: E402
from lessons.l16_weight_quant.weights import (EMBEDDING_FORMAT, QUANTIZED, WEIGHTS, check_weights,  # noqa: E402
                                              dequantized_model, gguf_model, quantized_model, weight_bytes)
from l11_smoke import DEFAULT_PROMPTS  # noqa: E402  (scripts/ is on the path when a smoke runs)
from l12_smoke import quality_tokens  # noqa: E402
from shared.cli import resolve_model_dir, smoke_parser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.named_models import NAMED, gguf_path  # noqa: E402
from shared.smoke import Setup, exit_with, prepare, run_smoke  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

# What each format's quality is judged against, teacher-forced: llama.cpp's way with the same blocks (activations
# rounded to 8 bits, llamacpp_way.py): what CPU users of such files accept today. Against bf16 compute, L12's
# yardstick, each format is printed, not judged: on the embedded model Q8_0's token embedding alone moves the
# distributions 1.76x as far as bf16 compute does, and Q4_1 140x (docs/l16_weight_quant.md, "Quality").
# Greedy tokens added to each prompt for the quality streams: with the default prompts (461 tokens) 2,861 positions.
# Q4_1 and llama.cpp's way differ by far less than Q4_1 differs from fp32, so their top-1 agreements differ by noise
# alone, and the paired interval must be narrower than the 1-point margin: about +-0.95 points at 1,021 positions
# (L12's count), +-0.78 at 2,061, +-0.66 here (embedded model, this course's CPU).
QUALITY_NEW_TOKENS = 300


def yardstick(fmt: str) -> str:
    return f"{fmt}, llama.cpp's way"


def parser():
    p = smoke_parser("L16", __doc__.split("\n\n")[0], blocks=True, default_prompts=DEFAULT_PROMPTS)
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--weights", default="auto", choices=("auto", *WEIGHTS),
                   help="the model's matrices: fp32 | bf16 (the checkpoint in that dtype) | q8_0 | q4_1 (blocks); "
                        "auto: a named model's shipped file (smollm2: q4_1), else q8_0 and q4_1 quantized here")
    p.add_argument("--parity", action="store_true",
                   help="with --weights q8_0 or q4_1 quantized here: instead of the quality contract, HF's tokens on "
                        "the dequantized weights (written once into the course cache as a checkpoint) and the logits "
                        "bitwise that model's, as for a shipped file (the parity matrix's L16 cells)")
    p.add_argument("--quality-new-tokens", type=quality_tokens, default=QUALITY_NEW_TOKENS,
                   help=f"greedy tokens added to each prompt for the quality streams (default {QUALITY_NEW_TOKENS})")
    return p


def check_weights_args(args) -> None:
    """One line for a --weights the other options contradict, before anything loads (weights.check_weights)."""
    args.dtype, args.device = check_weights(args.weights, args.dtype, args.device)


def shipped(args) -> Path | None:
    """The GGUF file a named model ships, when --weights asks for its format (auto or q4_1 on smollm2)."""
    if args.model in NAMED and args.weights in ("auto", "q4_1"):
        return gguf_path(NAMED[args.model])
    return None


def engine_options(args) -> dict:
    return dict(block_size=args.block_size, num_blocks=args.num_blocks, backend=args.backend)


# The exact paths: the shipped file (bitwise the fp32 model the harness loads, which is its dequantization) or
# --weights fp32/bf16 (L15's engine). shared.smoke checks every engine's tokens against HF's.

def build_engines(model: Qwen3ForCausalLM, args):
    gguf = shipped(args)
    if gguf is not None:
        args.quantized = gguf_model(resolve_model_dir(args.model, default_model_dir), gguf)
        args.quantized_from = f"{gguf.name} as shipped"
    elif getattr(args, "source", None) is not None:  # --parity: the harness loaded the dequantized checkpoint
        dense = Qwen3ForCausalLM.from_dir(args.source, torch.float32, torch.device("cpu"))
        args.quantized = quantized_model(dense, args.weights)
        args.quantized_from = f"{args.weights} quantized here from {args.source.name}, HF on its dequantized weights"
    else:
        args.quantized = model
    L16Engine(args.quantized, **engine_options(args))  # bad options fail here, before any run

    def l16(prompts, stop):
        return L16Engine(args.quantized, **engine_options(args)).generate_batch(prompts, stop)

    def l15(prompts, stop):
        return L15Engine(model, **engine_options(args)).generate_batch(prompts, stop)

    return {"L16": l16, "L15": l15}


def bitwise(quantized, dense, setup: Setup, args) -> tuple[bool, str]:
    """The quantized model's logits at every output position against the dense model's, each through its engine."""
    stop = setup.stop
    ours = run_recorded(L16Engine(quantized, **engine_options(args)), setup.prompt_ids, stop)
    theirs = run_recorded(L15Engine(dense, **engine_options(args)), setup.prompt_ids, stop)
    problems = [(i, d) for i, (a, b) in enumerate(zip(ours.logits, theirs.logits))
                if (d := first_difference(a, b)) is not None]
    positions = sum(len(x) for x in ours.logits)
    if problems:
        return False, f"prompt {problems[0][0]}: {problems[0][1]} ({len(problems)} of {len(ours.logits)} prompts differ)"
    return ours.tokens == theirs.tokens, (f"the logits at all {positions} output positions bitwise the fp32 "
                                          f"dequantized model's, the same tokens")


def exactness(model: Qwen3ForCausalLM, setup: Setup, args) -> tuple[bool, str] | None:
    if args.quantized is model:
        return None  # --weights fp32/bf16: L15's engine on the checkpoint; HF parity is the whole check
    ok, line = bitwise(args.quantized, model, setup, args)
    return ok, f"{args.quantized_from}, {weight_line(args.quantized, model)}: {line}"


def weight_line(quantized, dense) -> str:
    q, d = weight_bytes(quantized), weight_bytes(dense)
    return f"weights {q / 1e6:.1f} MB against fp32's {d / 1e6:.1f} MB ({q / d:.2f}x)"


# Quantized here from full precision: no HF reference (its tokens are not the test). Bitwise against the dequantized
# model, then the quality contract.

def quality(model: Qwen3ForCausalLM, dense: dict[str, Qwen3ForCausalLM], setup: Setup,
            args) -> tuple[dict[str, Quality], dict[str, float]]:
    """Every runner over the same streams (the prompts and the fp32 engine's greedy continuations), teacher-forced:
    fp32 is the reference; each format (its dequantized model), llama.cpp's way with its blocks, and bf16 compute
    are measured."""
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    context = setup.config.max_position_embeddings
    tails = L15Engine(model, **engine_options(args)).generate_batch(
        setup.prompt_ids, StopRule(max(1, min(args.quality_new_tokens, context - max(map(len, setup.prompt_ids)))),
                                   setup.stop.eos_token_ids, ignore_eos=True))
    streams = [ids + tail for ids, tail in zip(setup.prompt_ids, tails)]
    seconds["continuations"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    bf16 = Qwen3ForCausalLM.from_dir(setup.model_dir, torch.bfloat16, setup.device)
    n = blocks_for(max(map(len, streams)), args.block_size)

    def runner(m) -> PagedRunner:
        return PagedRunner(m, args.block_size, n, args.backend)

    tests = {"bf16": runner(bf16)}
    for fmt, weights in dense.items():
        tests |= {fmt: runner(weights), yardstick(fmt): runner(llamacpp_way(weights))}
    results = compare(runner(model), tests, streams)
    seconds["teacher-forced"] = time.perf_counter() - t0
    return results, seconds


def verdict_line(fmt: str, verdict: Judgement) -> str:
    if verdict.holds:
        return (f"{fmt} weights move the next-token distributions no more than llama.cpp's way with the same blocks "
                f"does: every 95% interval within its margin ({', '.join(m.name for m in verdict.measures)}; "
                f"{verdict.positions:,} positions)")
    failed = [f"{m.name} ({m.verdict})" for m in verdict.measures if m.verdict != "holds"]
    return f"{fmt} weights are not shown within llama.cpp's way's margins on {', '.join(failed)}"


def run_quantized(args) -> int:
    console = Console(stderr=args.json)
    setup = prepare(args, Console(stderr=True))
    formats = list(QUANTIZED) if args.weights == "auto" else [args.weights]
    seconds: dict[str, float] = {}
    with console.status("loading and quantizing the weights...") if not args.json else nullcontext():
        t0 = time.perf_counter()
        model = Qwen3ForCausalLM.from_dir(setup.model_dir, torch.float32, setup.device)
        quantized = {fmt: quantized_model(model, fmt) for fmt in formats}
        # Each format's dequantized model: the bitwise check's reference, and the quality runners' weights (a chunk's
        # 128 rows would take QuantLinear's prefill path, torch's GEMM over these very values, dequantizing every
        # matrix for every chunk; the bitwise check below is what lets the dense model stand in)
        dense = {fmt: dequantized_model(q) for fmt, q in quantized.items()}
        seconds["load + quantize"] = time.perf_counter() - t0
    report: dict[str, dict] = {}
    for fmt, q in quantized.items():
        t0 = time.perf_counter()
        outputs = L16Engine(q, **engine_options(args)).generate_batch(setup.prompt_ids, setup.stop)
        seconds[f"L16 {fmt}"] = time.perf_counter() - t0
        exact, line = bitwise(q, dense[fmt], setup, args)
        report[fmt] = {"outputs": outputs, "exact": exact, "exact_line": line, "weights": weight_line(q, model)}
    with console.status("the quality contract: teacher-forced...") if not args.json else nullcontext():
        results, more = quality(model, dense, setup, args)
    seconds |= more
    for fmt in formats:
        verdict = judge(results[fmt], results[yardstick(fmt)])
        report[fmt] |= {"verdict": verdict, "contract": verdict.holds}
    ok = all(r["exact"] and r["contract"] for r in report.values())
    if args.json:
        print(json.dumps({
            "lesson": "L16", "weights": formats, "model": str(setup.model_dir),
            "max_new_tokens": setup.stop.max_new_tokens, "ignore_eos": setup.stop.ignore_eos,
            "formats": {fmt: {"outputs": r["outputs"], "exact": r["exact"], "exact_message": r["exact_line"],
                              "weights": r["weights"], "yardstick": yardstick(fmt), "contract_holds": r["contract"],
                              "judgement": [vars(m) for m in r["verdict"].measures],
                              "message": verdict_line(fmt, r["verdict"])} for fmt, r in report.items()},
            "quality": {name: {"positions": q.positions, "mean_kl": q.mean_kl, "p99_kl": q.p99_kl,
                               "p999_kl": q.p999_kl, "top1": q.top1} for name, q in results.items()},
            "seconds": {k: round(v, 4) for k, v in seconds.items()}, "ok": ok}))
        return 0 if ok else 1
    console.print(f"[bold]L16 smoke[/] · weights {', '.join(formats)} (quantized here from the checkpoint; the "
                  f"embedding {', '.join(f'{EMBEDDING_FORMAT[f]} with {f}' for f in formats)}) · model "
                  f"{setup.model_dir} · cpu, fp32 activations · max-new-tokens {setup.stop.max_new_tokens}",
                  soft_wrap=True)
    for fmt, r in report.items():
        console.rule(f"{fmt}: {r['weights']}")
        for i, (ids, out) in enumerate(zip(setup.prompt_ids, r["outputs"])):
            console.print(escape(f"prompt {i} ({len(ids)} tokens): {len(out)} new: {setup.tokenizer.decode(out)!r}"),
                          soft_wrap=True, highlight=False)
        console.print(("[bold green]PASS[/] exact: " if r["exact"] else "[bold red]FAIL[/] exact: ") + escape(r["exact_line"]),
                      soft_wrap=True)
        yard, bf16 = results[yardstick(fmt)], results["bf16"]
        console.print(escape(f"{fmt}: {results[fmt].line()}"), soft_wrap=True, highlight=False)
        console.print(escape(f"{yardstick(fmt)} (yardstick): {yard.line()}"), soft_wrap=True, highlight=False)
        for m in r["verdict"].measures:
            console.print(escape(f"  {m.line()}"), soft_wrap=True, highlight=False)
        console.print(escape(f"  against bf16 compute (printed, not judged): mean KL {results[fmt].mean_kl / bf16.mean_kl:.3g}x "
                             f"bf16's, top-1 agreement {results[fmt].top1:.2%} vs {bf16.top1:.2%}"), soft_wrap=True,
                      highlight=False)
        console.print(("[bold green]PASS[/] the contract: " if r["contract"] else "[bold red]FAIL[/] the contract: ")
                      + escape(verdict_line(fmt, r["verdict"])), soft_wrap=True)
    console.rule("timing")
    for name, s in seconds.items():
        console.print(f"{name}: {s:.2f} s")
    return 0 if ok else 1


def main() -> None:
    args = parser().parse_args()

    def run() -> int:
        check_weights_args(args)
        if args.parity and args.weights not in QUANTIZED:
            raise CourseError(f"--parity needs --weights {' or '.join(QUANTIZED)} (the formats quantized here), "
                              f"not {args.weights}")
        if args.weights in ("fp32", "bf16") or shipped(args) is not None:
            return run_smoke("L16", args, build_engines, exactness)
        if args.parity:  # HF, and the harness's model, read the dequantized checkpoint; L16 the blocks of the source
            args.source = resolve_model_dir(args.model, default_model_dir)
            args.model = str(dequantized_checkpoint(args.source, args.weights))
            return run_smoke("L16", args, build_engines, exactness)
        return run_quantized(args)

    exit_with(run)


if __name__ == "__main__":
    main()

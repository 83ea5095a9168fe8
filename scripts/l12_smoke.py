"""L12 smoke: a quantized KV cache. K and V are stored as int8 rows, one fp32 scale per token and KV head inside
each row, and the C++ kernel reads them in place. The pool is sized in bytes, so int8 fits about twice the
bf16 blocks into the same memory. Exact tokens are no longer the test for int8: the smoke runs L11's workload
on int8 pages, then measures the quality contract teacher-forced (fp32 model, full-precision KV against int8
KV, with the model computed in bf16 as the yardstick). With --kv-dtype auto it is L11's engine exactly, and
every request's greedy tokens must equal HF's and L11's, as in L11's smoke.

    python scripts/l12_smoke.py                       # int8 pages: blocks in the same bytes, the quality contract
    python scripts/l12_smoke.py --kv-bytes 4000000    # a smaller pool budget, in bytes
    python scripts/l12_smoke.py --kv-dtype auto       # the model's dtype: HF parity, as in L11's smoke
    python scripts/l12_smoke.py --tp 2                # over L10's split model, rank 1 spawned here
"""
from __future__ import annotations

import argparse
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
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING, Arrival  # noqa: E402
from lessons.l8_chunked_prefill.scheduler import DEFAULT_MAX_BATCHED_TOKENS  # noqa: E402
from lessons.l10_tensor_parallel.group import DEFAULT_TIMEOUT_S  # noqa: E402
from lessons.l10_tensor_parallel.launch import follow_if_torchrun, start  # noqa: E402
from lessons.l10_tensor_parallel.layout import check_tp  # noqa: E402
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM  # noqa: E402
from lessons.l11_speculative import L11Engine  # noqa: E402
from lessons.l11_speculative.engine import DEFAULT_NUM_SPECULATIVE_TOKENS, check_num_speculative_tokens  # noqa: E402
from lessons.l11_speculative.ngram import NgramDrafter  # noqa: E402
from lessons.l11_speculative.draft_model import DraftModelDrafter  # noqa: E402
from lessons.l12_kv_quant import L12Engine, L12TpEngine  # noqa: E402
from lessons.l12_kv_quant.engine import blocks_in, storage_dtype  # noqa: E402
from lessons.l12_kv_quant.kv_pool import block_bytes  # noqa: E402
from lessons.l12_kv_quant.quality import KL_MARGIN, TOP1_MARGIN, Judgement, Quality, compare, judge  # noqa: E402
from lessons.l12_kv_quant.runner import KV_DTYPES, quantized  # noqa: E402
from l11_smoke import DEFAULT_PROMPTS, DRAFTERS, arrival_step, speculative_tokens  # noqa: E402  (scripts/ on the path)
from shared.cli import resolve_model_dir, smoke_parser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.pool_trace import record_engine  # noqa: E402
from shared.smoke import Setup, exit_with, prepare, run_smoke  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

# Greedy tokens the full-precision engine adds to each prompt for the quality streams: with the default prompts
# (461 tokens) that is 1,021 positions, past the 1,000 the contract is stated over. Each position costs one LM
# head over the whole vocabulary per runner (three runners), the bulk of the smoke's time.
QUALITY_NEW_TOKENS = 70
KV_DEFAULT = "int8"  # the smoke shows the new pool; the engine's own default is "auto" (every earlier lesson's)


def whole_number(unit: str, one: str):
    """An argparse type: a whole number of `unit` of at least 1, refused at parse time (one line, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {unit}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} is below 1 {one}")
        return value
    parse.__name__ = unit  # argparse names the type in its error line
    return parse


kv_bytes = whole_number("bytes", "byte")  # --kv-bytes
quality_tokens = whole_number("tokens", "token")  # --quality-new-tokens


def parser():
    p = smoke_parser("L12", __doc__.split("\n\n")[0], blocks=True, default_prompts=DEFAULT_PROMPTS,
                     pool_default="as many as --kv-bytes holds in the --kv-dtype's storage")
    p.add_argument("--kv-dtype", default=KV_DEFAULT, choices=KV_DTYPES,
                   help=f"{', '.join(k for k in KV_DTYPES if k != 'auto')}: quantized pages and the quality contract; "
                        f"auto: the model's dtype and HF parity (default: {KV_DEFAULT}; the engine's own default is "
                        f"auto)")
    p.add_argument("--quality-new-tokens", type=quality_tokens, default=QUALITY_NEW_TOKENS,
                   help=f"greedy tokens added to each prompt for the quality streams (default {QUALITY_NEW_TOKENS}); "
                        f"more positions narrow the contract's intervals")
    p.add_argument("--kv-bytes", type=kv_bytes,
                   help="the pool's memory budget in bytes (default: L11's default pool, 4096 tokens in the model's "
                        "dtype)")
    p.add_argument("--drafter", default="ngram", choices=DRAFTERS,
                   help="ngram: prompt lookup in the request's own tokens; draft: the target drafting for itself "
                        "(default: ngram)")
    p.add_argument("--num-speculative-tokens", type=speculative_tokens, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                   help=f"K, most drafts per request per step; 0: no speculation (default: "
                        f"{DEFAULT_NUM_SPECULATIVE_TOKENS})")
    p.add_argument("--tp", type=int, default=1, help="ranks the engine's model is split across (default: 1)")
    p.add_argument("--tp-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds a rank waits in a collective before the run fails (default: {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--max-batched-tokens", type=int, default=DEFAULT_MAX_BATCHED_TOKENS,
                   help=f"the token budget of one step, drafts included (default: {DEFAULT_MAX_BATCHED_TOKENS})")
    p.add_argument("--max-slice-tokens", type=int, help="most prompt tokens one request computes in a step")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="most requests in one step")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="off: every step eager")
    return p


def check_options(args) -> None:
    """What argparse cannot see alone; before anything is loaded."""
    check_num_speculative_tokens(args.num_speculative_tokens)
    if args.kv_bytes is not None and args.num_blocks is not None:
        raise CourseError("give --kv-bytes or --num-blocks, not both (a block count overrides the byte budget)")


def engine_options(args) -> dict:
    return dict(graphs=args.graphs == "on", max_batched_tokens=args.max_batched_tokens,
                max_slice_tokens=args.max_slice_tokens)


def make_engine(cls, model, args, **kwargs):
    return cls(model, args.block_size, args.num_blocks, args.max_running, args.backend, **engine_options(args),
               **kwargs)


def make_l12(model, args) -> L12Engine:
    """The engine under test, kv_dtype from the command line, on one rank or over L10's split model."""
    spec = {"drafter": NgramDrafter() if args.drafter == "ngram" else DraftModelDrafter(model, args.backend),
            "num_speculative_tokens": args.num_speculative_tokens}
    pool = {"kv_dtype": args.kv_dtype, "kv_bytes": args.kv_bytes}
    if args.tp == 1:
        return make_engine(L12Engine, model, args, **pool, **spec)
    group = start(args.tp, model.lm_head.weight.device, args.tp_timeout)
    tp_model = TpQwen3ForCausalLM.load(resolve_model_dir(args.model, default_model_dir), model.lm_head.weight.dtype,
                                       group)
    try:
        return make_engine(L12TpEngine, tp_model, args, **pool, **spec)
    except CourseError:
        group.close()  # the followers are waiting for a first step that will never come
        raise


def workload(prompts: list[list[int]], stop: StopRule) -> list[Arrival]:
    return [Arrival(p, stop, step=arrival_step(i)) for i, p in enumerate(prompts)]


def run_engine(engine: L12Engine, prompts: list[list[int]], stop: StopRule, args) -> list[list[int]]:
    try:
        return engine.run(workload(prompts, stop))
    finally:
        if args.tp > 1:
            engine.close()  # the followers stop now: what runs next gets the CPU to itself


def pool_report(engine: L12Engine, model_dtype: torch.dtype, args) -> dict:
    """The pool's bytes and the blocks they hold in int8, bf16 and fp32 (blocks_in: whole blocks, scales included).
    Over --tp ranks, one rank's: its model's config holds its own KV heads, and so does its pool."""
    cfg, size = engine.model.config, args.block_size
    stored = storage_dtype(engine.kv_dtype, model_dtype)
    budget = getattr(engine, "kv_bytes", None)  # absent when --num-blocks sized the pool
    if budget is None:
        budget = engine.usable_blocks * block_bytes(cfg, size, stored)
    quant = engine.kv_dtype if engine.kv_dtype != "auto" else "int8"  # auto: show what int8 would fit
    kinds = ((quant, storage_dtype(quant, model_dtype)), ("bf16", torch.bfloat16), ("fp32", torch.float32))
    blocks = {name: blocks_in(budget, cfg, size, dtype) for name, dtype in kinds}
    sizes = {name: block_bytes(cfg, size, dtype) for name, dtype in kinds}
    how = ("--num-blocks" if args.num_blocks is not None else "--kv-bytes" if args.kv_bytes is not None
           else f"L11's default pool: 4096 tokens in {str(model_dtype).removeprefix('torch.')}")
    if args.tp > 1:
        how += f"; one rank's pool of {args.tp}, its own KV heads"
    return {"kv_bytes": budget, "sized_by": how, "block_size": size, "stored": str(stored).removeprefix("torch."),
            "usable_blocks": engine.usable_blocks, "quantized": quant, "blocks": blocks, "block_bytes": sizes,
            "vs_bf16": blocks[quant] / blocks["bf16"], "vs_fp32": blocks[quant] / blocks["fp32"]}


def pool_line(pool: dict) -> str:
    b, s, q = pool["blocks"], pool["block_bytes"], pool["quantized"]
    return (f"pool: {pool['kv_bytes']:,} bytes ({pool['sized_by']}), blocks of {pool['block_size']} tokens: "
            f"{q} {b[q]:,} ({s[q]:,} B each, scales included) vs bf16 {b['bf16']:,} ({s['bf16']:,} B) "
            f"and fp32 {b['fp32']:,} ({s['fp32']:,} B) in the same bytes: {pool['vs_bf16']:.2f}x bf16's blocks, "
            f"{pool['vs_fp32']:.2f}x fp32's; this engine's pool ({pool['stored']}): {pool['usable_blocks']:,} "
            f"usable blocks")


def leak_line(engine: L12Engine) -> tuple[bool, str]:
    free, usable = engine.allocator.num_free, engine.usable_blocks
    return free == usable, f"{free:,} of {usable:,} usable blocks free or cached at the end" + (
        "" if free == usable else " (LEAK)")


# --kv-dtype auto: L11's smoke, on L12's engine. shared.smoke runs each engine and checks every one against HF.

def build_engines(model, args):
    check_tp(model.config, args.tp)
    args.l12 = make_l12(model, args)
    args.model_dtype = model.lm_head.weight.dtype

    def l12(prompts, stop):
        return run_engine(args.l12, prompts, stop, args)

    def l11(prompts, stop):  # the predecessor, same options and arrivals, on one rank
        drafter = NgramDrafter() if args.drafter == "ngram" else DraftModelDrafter(model, args.backend)
        args.l11 = make_engine(L11Engine, model, args, drafter=drafter,
                               num_speculative_tokens=args.num_speculative_tokens)
        return args.l11.run(workload(prompts, stop))

    return {"L12": l12, "L11": l11}


def parity_report(model, setup: Setup, args) -> tuple[bool, str]:
    eng = args.l12
    same_class = type(eng.runner) is type(args.l11.runner) or args.tp > 1  # over ranks: L11TpEngine's TpRunner
    whose = (" (L11TpEngine's runner)" if args.tp > 1 else " (L11 runs the same class)" if same_class
             else " (NOT L11's runner class)")
    no_leak, leak = leak_line(eng)
    ranks = "" if args.tp == 1 else f" on {args.tp} ranks"
    line = (f"L12{ranks}, kv-dtype auto: {type(eng.runner).__name__}"
            f"{whose}, {eng.spec.line()}\n"
            f"  {pool_line(pool_report(eng, args.model_dtype, args))}\n  {leak}")
    return no_leak and same_class, line


# --kv-dtype int8 (or another quantized dtype): no HF reference (its tokens are not the test); the quality contract is.

def continuations(model: Qwen3ForCausalLM, setup: Setup, args) -> list[list[int]]:
    """--quality-new-tokens greedy tokens per prompt from the full-precision engine (kv-dtype auto, no drafts), EOS
    ignored so every stream has its length; fewer where the model's context ends first."""
    engine = make_engine(L12Engine, model, args, kv_dtype="auto", drafter=None)
    context = setup.config.max_position_embeddings
    arrivals = [Arrival(ids, StopRule(max(1, min(args.quality_new_tokens, context - len(ids))), setup.stop.eos_token_ids,
                                      ignore_eos=True)) for ids in setup.prompt_ids]
    return engine.run(arrivals)


def quality(model: Qwen3ForCausalLM, setup: Setup, args) -> tuple[list[list[int]], dict[str, Quality], dict]:
    """The contract's three runners over the same streams: fp32 model with fp32 KV (reference), the same model
    with quantized KV (test), the model loaded in bf16 (yardstick). Returns streams, {kv-dtype, "bf16"} -> Quality,
    seconds."""
    seconds = {}
    t0 = time.perf_counter()
    fp32 = model if setup.dtype == torch.float32 else Qwen3ForCausalLM.from_dir(setup.model_dir, torch.float32,
                                                                                setup.device)
    bf16 = Qwen3ForCausalLM.from_dir(setup.model_dir, torch.bfloat16, setup.device)
    seconds["load fp32/bf16"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    streams = [ids + tail for ids, tail in zip(setup.prompt_ids, continuations(fp32, setup, args))]
    seconds["continuations"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = blocks_for(max(map(len, streams)), args.block_size)
    ref = PagedRunner(fp32, args.block_size, n, args.backend)
    tests = {args.kv_dtype: quantized(PagedRunner, args.kv_dtype)(fp32, args.block_size, n, args.backend),
             "bf16": PagedRunner(bf16, args.block_size, n, args.backend)}
    results = compare(ref, tests, streams)
    seconds["teacher-forced"] = time.perf_counter() - t0
    return streams, results, seconds


def worst_line(q: Quality, name: str, setup: Setup) -> str:
    """The position of the largest KL and both sides' top tokens there, as ids and text."""
    w = q.worst
    where = "prompt" if w.position < len(setup.prompt_ids[w.stream]) else "continuation"
    text = setup.tokenizer.decode
    return (f"worst {name} position: prompt {w.stream} position {w.position} (in its {where}), KL {w.kl:.3g}: "
            f"fp32 KV's top token {w.ref_top} {text([w.ref_top])!r}, {name}'s {w.test_top} {text([w.test_top])!r}")


def contract_line(kv: str, verdict: Judgement, test: Quality, setup: Setup) -> str:
    """What the contract's verdict says: when it fails, the measures that broke it, why, and the worst position."""
    if verdict.holds:
        return (f"{kv} KV moves the next-token distributions no more than bf16 compute does: every 95% interval "
                f"within its margin ({', '.join(m.name for m in verdict.measures)}; {verdict.positions:,} positions)")
    failed = [f"{m.name} ({m.verdict}{': more positions (--quality-new-tokens) narrow it' * (m.verdict == 'unresolved')})"
              for m in verdict.measures if m.verdict != "holds"]
    return (f"{kv} KV is not shown within the bf16 yardstick's margins on {', '.join(failed)}; "
            f"{worst_line(test, kv, setup)}")


def agreement(ours: list[int], full: list[int]) -> int:
    """Leading tokens the quantized run shares with the full-precision one."""
    n = 0
    while n < min(len(ours), len(full)) and ours[n] == full[n]:
        n += 1
    return n


def run_quantized(args) -> int:
    kv = args.kv_dtype
    console = Console(stderr=args.json)
    setup = prepare(args, Console(stderr=True))
    seconds = {}
    with console.status("loading weights...") if not args.json else nullcontext():
        t0 = time.perf_counter()
        model = Qwen3ForCausalLM.from_dir(setup.model_dir, setup.dtype, setup.device)
        seconds["load"] = time.perf_counter() - t0
        check_tp(model.config, args.tp)
        engine = make_l12(model, args)
    t0 = time.perf_counter()
    with record_engine(engine, args.trace, "l12"):  # --trace: the int8 engine's run (not the quality contract's)
        outputs = run_engine(engine, setup.prompt_ids, setup.stop, args)
    seconds[f"L12 {kv}"] = time.perf_counter() - t0
    no_leak, leak = leak_line(engine)
    pool = pool_report(engine, setup.dtype, args)
    with console.status("the quality contract: teacher-forced, three runners...") if not args.json else nullcontext():
        streams, results, more = quality(model, setup, args)
    seconds |= more
    quant_q, bf16_q = results[kv], results["bf16"]
    verdict = judge(quant_q, bf16_q)
    contract = verdict.holds
    ok = contract and no_leak
    full_precision = setup.dtype == torch.float32  # the continuations are the fp32 engine's: comparable tokens
    agree = [agreement(o, s[len(ids):]) if full_precision else None
             for o, s, ids in zip(outputs, streams, setup.prompt_ids)]
    if args.json:
        print(json.dumps({
            "lesson": "L12", "kv_dtype": kv, "model": str(setup.model_dir), "device": str(setup.device),
            "dtype": str(setup.dtype).removeprefix("torch."), "max_new_tokens": setup.stop.max_new_tokens,
            "ignore_eos": setup.stop.ignore_eos,
            "prompts": [{"prompt": text, "prompt_ids": ids, "L12": out, "agrees_with_fp32_kv": n}
                        for text, ids, out, n in zip(setup.prompts, setup.prompt_ids, outputs, agree)],
            "pool": pool, "leak": not no_leak,
            "quality": {name: {"positions": q.positions, "mean_kl": q.mean_kl, "p99_kl": q.p99_kl,
                               "p999_kl": q.p999_kl, "top1": q.top1, "worst": vars(q.worst)}
                        for name, q in results.items()},
            "judgement": [vars(m) for m in verdict.measures], "tail_note": verdict.tail_note,
            "contract_holds": contract, "message": contract_line(kv, verdict, quant_q, setup),
            "seconds": {k: round(v, 4) for k, v in seconds.items()}, "ok": ok}))
        return 0 if ok else 1
    dtype = str(setup.dtype).removeprefix("torch.")
    console.print(f"[bold]L12 smoke[/] · kv-dtype {kv} · model {setup.model_dir} · {setup.device} {dtype} · "
                  f"max-new-tokens {setup.stop.max_new_tokens}{' · ignore-eos' if setup.stop.ignore_eos else ''}"
                  f"{'' if args.tp == 1 else f' · {args.tp} ranks'}", soft_wrap=True)
    console.print(escape(pool_line(pool)), soft_wrap=True, highlight=False)
    console.rule(f"L12 on {kv} pages (L11's workload and arrivals)")
    for i, (text, ids, out) in enumerate(zip(setup.prompts, setup.prompt_ids, outputs)):
        same = "" if agree[i] is None else f"; {agree[i]} of {len(out)} leading tokens as with fp32 KV"
        console.print(escape(f"prompt {i} ({len(ids)} tokens): {len(out)} new{same}: "
                             f"{setup.tokenizer.decode(out)!r}"), soft_wrap=True, highlight=False)
    console.print(escape(f"spec: {engine.spec.line()}; {leak}"), soft_wrap=True, highlight=False)
    console.rule("quality: teacher-forced against fp32 KV on the fp32 model")
    console.print(escape(f"streams: {len(streams)} prompts + {args.quality_new_tokens} greedy tokens each from the "
                         f"full-precision engine (EOS ignored), {sum(map(len, streams)):,} positions"),
                  soft_wrap=True, highlight=False)
    console.print(escape(f"{kv + ' KV':<15}: {quant_q.line()}"), soft_wrap=True, highlight=False)
    console.print(escape(f"bf16 model     : {bf16_q.line()}  (the yardstick)"), soft_wrap=True, highlight=False)
    console.print(escape(worst_line(quant_q, kv, setup)), soft_wrap=True, highlight=False)
    console.print(escape(f"{kv} against bf16, paired, 95% block-bootstrap intervals (margins {KL_MARGIN}x KL, "
                         f"{100 * TOP1_MARGIN:g} point top-1): {verdict.line()}"
                         f"{'; ' + verdict.tail_note if verdict.tail_note else ''}"), soft_wrap=True, highlight=False)
    console.rule("timing")
    for name, s in seconds.items():
        console.print(f"{name:>16}: {s:7.3f} s", highlight=False)
    mark = "[bold green]PASS[/]: " if contract else "[bold red]FAIL[/]: "
    console.print(mark + escape(contract_line(kv, verdict, quant_q, setup)), soft_wrap=True, highlight=False)
    console.print(("[bold green]PASS[/]: " if no_leak else "[bold red]FAIL[/]: ") + escape(leak), soft_wrap=True,
                  highlight=False)
    return 0 if ok else 1


def run(args) -> int:
    check_options(args)
    if args.kv_dtype == "auto":
        return run_smoke("L12", args, build_engines, parity_report)
    return run_quantized(args)


def main() -> None:
    """shared.smoke.main's contract for both paths: a CourseError is one line and exit 2, a RunFailure exit 1."""
    args = parser().parse_args()
    exit_with(lambda: run(args))


if __name__ == "__main__":
    follow_if_torchrun()  # under torchrun, ranks above 0 follow rank 0 and never get here
    main()

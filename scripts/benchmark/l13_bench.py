"""Structured output's price, measured in one run: constrained against unconstrained decoding, the mask's time
per step, and what compiling a grammar costs, fresh and from the cache.

    OMP_NUM_THREADS=1 python scripts/benchmark/l13_bench.py [--batches 1,16] [--prompt-len 32] [--steps 32]
        [--string-length 1000] [--rounds 5] [--compile-rounds 5] [--model smollm2] [--json PATH]

a. Decode throughput. L13's engine on the embedded model (or --model's), fp32, greedy, graphs on as the engine's default. Per
   batch B: B random prompts of --prompt-len tokens, all arriving at once, a token budget that prefills them in
   one step, then --steps decode steps with EOS ignored; only the decode steps are timed, and only while all B
   requests still run. Two systems on the same prompts: unconstrained, and constrained by a JSON schema whose
   one field is a string of exactly --string-length characters, compiled before the rounds and taken from the
   compiler's cache in each round (as the hundredth request with a schema is). A grammar's end ends its output
   (its EOS stops the request even with ignore_eos), so the schema is one that cannot end within the steps
   measured: a constrained request that ends early stops the benchmark. Per round a fresh engine per system,
   the two taking turns a step at a time in harness.alternate's order; the median of --rounds rounds. Every
   constrained output is checked afterwards: a fresh matcher takes in every token (the output is a valid prefix
   of the schema's language) and its text starts as the schema says.
b. The mask's time per decode step, from the same constrained runs: the engine's own counter
   (engine.mask_seconds, engine.masked_rows), split into llguidance's fill (mask.fill: the matcher writes its
   bitmask row), the unpack and -inf (mask.apply), and the rest of mask_rows (the bitmask's allocation, the
   gather and write-back of the masked logits rows); beside it, advancing the matchers after the sample
   (engine.advance), which the counter does not include.
c. Compiling: llguidance's tokenizer load (once per process), then per schema (small, nested, a large enum,
   the long string of a) GrammarCompiler.compile fresh (the schema dropped from the cache first) and from the
   cache, a request's matcher copy, and the first mask of a fresh matcher (llguidance builds its lexer states
   lazily, so the first masks after a compile cost more than later ones): medians of --compile-rounds.
Target: constrained decode throughput >= 0.9x unconstrained at batch 16 with a cached grammar.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark's own modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import harness  # noqa: E402
from l11_bench import ints  # noqa: E402
from lessons.l4_continuous.sampling import SamplingParams  # noqa: E402
from lessons.l13_structured import L13Engine, engine as l13_engine, mask  # noqa: E402
from lessons.l13_structured.grammar import Grammar, GrammarCompiler, GrammarSpec  # noqa: E402
from lessons.l13_structured.sampling import ConstrainedSampling  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.config import Qwen3Config  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

BLOCK = 16
TARGET = 0.9
TARGET_BATCH = 16
SYSTEMS = ("unconstrained", "constrained")
TEXT_PREFIX = '{"text":"'  # what every output of long_string_schema starts with


def long_string_schema(length: int) -> dict:
    """One string field of exactly `length` characters: bounded, yet no end within the measured steps."""
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": length, "maxLength": length}},
            "required": ["text"], "additionalProperties": False}


def compile_schemas(string_length: int) -> dict[str, dict]:
    """The schemas section c compiles: a small record, a nested one, a large enum, and section a's."""
    small = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
    address = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                                "city": {"type": "string", "maxLength": 20},
                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
               "required": ["street", "city", "zip"], "additionalProperties": False}
    nested = {"type": "object", "properties": {
        "id": {"type": "integer"}, "owner": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30}, "email": {"type": "string", "maxLength": 50},
            "address": address}, "required": ["name", "address"], "additionalProperties": False},
        "items": {"type": "array", "maxItems": 10, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1},
            "price": {"type": "number"}, "options": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                       "maxItems": 4}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]}},
        "required": ["id", "owner", "items", "status"], "additionalProperties": False}
    rng = random.Random(1)
    words = sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 12)))
                    for _ in range(1200)})[:1000]
    enum = {"type": "object", "properties": {"city": {"enum": words}}, "required": ["city"],
            "additionalProperties": False}
    return {"small record": small, "nested record": nested, f"enum of {len(words):,}": enum,
            f"string of {string_length:,}": long_string_schema(string_length)}


class Timers:
    """Seconds spent in mask.fill, mask.apply and engine.advance, while `timing()` is on: the engine calls them
    through their modules, so wrapping the module attributes times exactly its calls (a perf_counter pair each,
    well under a microsecond)."""

    def __init__(self):
        self.fill = self.apply = self.advance = 0.0

    @contextmanager
    def timing(self) -> Iterator["Timers"]:
        originals = mask.fill, mask.apply, l13_engine.advance

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    setattr(self, name, getattr(self, name) + time.perf_counter() - t0)
            return wrapper

        mask.fill, mask.apply = timed("fill", originals[0]), timed("apply", originals[1])
        l13_engine.advance = timed("advance", originals[2])
        try:
            yield self
        finally:
            mask.fill, mask.apply, l13_engine.advance = originals


class Run:
    """One system's B requests on a fresh engine: one prefill step, then decode steps timed while all B run."""

    def __init__(self, model: Qwen3ForCausalLM, prompts: list[list[int]], steps: int, grammar: Grammar | None):
        n = len(prompts)
        self.engine = L13Engine(model, BLOCK, None, max_running=n, max_batched_tokens=n * len(prompts[0]))
        sampling = SamplingParams() if grammar is None else ConstrainedSampling(grammar=grammar)
        stop = StopRule(steps + 1, ignore_eos=True)  # the prefill step gives each request its first token
        self.seqs = [self.engine.add_request(p, stop, sampling) for p in prompts]
        self.timers = Timers()
        self.decode_s, self.steps, self.tokens = 0.0, 0, 0
        self.mask_s = self.masked = 0

    def step(self) -> None:
        seqs, engine = self.seqs, self.engine
        decoding = all(s.output_ids for s in seqs) and len(engine.scheduler.running) == len(seqs)
        before, mask_before, rows_before = sum(len(s.output_ids) for s in seqs), engine.mask_seconds, engine.masked_rows
        fill, apply, advance = self.timers.fill, self.timers.apply, self.timers.advance
        with self.timers.timing():
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
        if not decoding:  # the prefill step, or a step after a request ended: not counted anywhere
            self.timers.fill, self.timers.apply, self.timers.advance = fill, apply, advance
            return
        self.decode_s, self.steps = self.decode_s + dt, self.steps + 1
        self.tokens += sum(len(s.output_ids) for s in seqs) - before
        self.mask_s += engine.mask_seconds - mask_before
        self.masked += engine.masked_rows - rows_before

    def result(self) -> dict:
        t = self.timers
        return {"decode_s": self.decode_s, "steps": self.steps, "tokens": self.tokens, "mask_s": self.mask_s,
                "masked_rows": self.masked, "fill_s": t.fill, "apply_s": t.apply, "advance_s": t.advance,
                "outputs": [list(s.output_ids) for s in self.seqs], "backend": harness.backend_name(self.engine)}


def check_constrained(outputs: list[list[int]], grammar: Grammar, tokenizer, steps: int) -> None:
    """Every constrained output a valid prefix of the schema's language, as long as asked (none ended early)."""
    for ids in outputs:
        matcher = grammar.matcher()
        if not matcher.consume_tokens(ids) or matcher.is_error():
            raise CourseError(f"a constrained output left its grammar: {tokenizer.decode(ids)[:80]!r}")
        text = tokenizer.decode(ids)
        if not (text.startswith(TEXT_PREFIX) or TEXT_PREFIX.startswith(text)):
            raise CourseError(f"a constrained output does not start {TEXT_PREFIX!r}: {text[:40]!r}")
        if len(ids) != steps + 1:
            raise CourseError(f"a constrained output ended after {len(ids)} of {steps + 1} tokens: raise "
                              "--string-length so the grammar cannot end within the steps measured")


def decode(model, compiler: GrammarCompiler, tokenizer, args, console: Console) -> tuple[list[dict], set[str]]:
    cfg = model.config
    spec = GrammarSpec("json_schema", long_string_schema(args.string_length))
    compiler.compile(spec)  # compiled once here; each round takes it from the cache
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(min(cfg.vocab_size, 151643)) for _ in range(args.prompt_len)]
               for _ in range(max(args.batches))]
    rows, used = [], set()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress, torch.inference_mode():
        for batch in args.batches:
            task = progress.add_task(f"batch {batch}: rounds", total=args.rounds)
            runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
            for _ in range(args.rounds):
                grammar = compiler.compile(spec)  # a cache hit
                live = {name: Run(model, prompts[:batch], args.steps, grammar if name == "constrained" else None)
                        for name in SYSTEMS}
                for _, name in harness.alternate(list(SYSTEMS), 10**9):  # a step each, in turns, until all finish
                    if not any(run.engine.scheduler.has_work() for run in live.values()):
                        break
                    if live[name].engine.scheduler.has_work():
                        live[name].step()
                for name, run in live.items():
                    runs[name].append(run.result())
                check_constrained(runs["constrained"][-1]["outputs"], grammar, tokenizer, args.steps)
                progress.advance(task)
            plain = runs["unconstrained"]
            for name, rs in runs.items():
                used |= {r["backend"] for r in rs}
                # per round, this system's throughput over the unconstrained one's in the same round
                ratios = sorted((r["tokens"] / r["decode_s"]) / (p["tokens"] / p["decode_s"])
                                for r, p in zip(rs, plain))
                rs = sorted(rs, key=lambda r: r["tokens"] / r["decode_s"])
                mid = rs[len(rs) // 2]  # the median round (the upper one of two)
                rows.append({"batch": batch, "system": name, "tok_s": mid["tokens"] / mid["decode_s"],
                             "step_ms": 1e3 * mid["decode_s"] / mid["steps"], "steps": mid["steps"],
                             "tok_s_range": [r["tokens"] / r["decode_s"] for r in (rs[0], rs[-1])],
                             "ratio": statistics.median(ratios), "ratio_range": [ratios[0], ratios[-1]],
                             **{k: mid[k] for k in ("mask_s", "masked_rows", "fill_s", "apply_s", "advance_s")},
                             "outputs": [tokenizer.decode(ids) for ids in mid["outputs"][:2]]})
            console.print(f"  batch {batch}: " + ", ".join(
                f"{r['system']} {r['tok_s']:,.0f} tok/s" for r in rows if r["batch"] == batch), highlight=False)
    return rows, used


def median_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compiling(compiler: GrammarCompiler, tokenizer_load_s: float, args) -> list[dict]:
    rows = [{"schema": "tokenizer (LLTokenizer, once per process)", "fresh_ms": 1e3 * tokenizer_load_s}]
    bitmask = mask.allocate(1, compiler.vocab_size)
    for name, schema in compile_schemas(args.string_length).items():
        spec = GrammarSpec("json_schema", schema)

        fresh, first = [], []
        for _ in range(args.compile_rounds):
            compiler._cache.pop(spec.key, None)  # a miss: what the first request with this schema pays
            t0 = time.perf_counter()
            matcher = compiler.compile(spec).matcher()
            t1 = time.perf_counter()
            mask.fill(matcher, bitmask, 0)
            fresh.append(t1 - t0)
            first.append(time.perf_counter() - t1)
        fresh_s, first_s = statistics.median(fresh), statistics.median(first)
        grammar = compiler.compile(spec)
        hit_s = median_seconds(lambda: compiler.compile(spec), 10 * args.compile_rounds)
        copy_s = median_seconds(grammar.matcher, 10 * args.compile_rounds)
        mask_s = median_seconds(lambda: mask.fill(matcher, bitmask, 0), 10 * args.compile_rounds)  # state seen before
        rows.append({"schema": name, "schema_bytes": len(json.dumps(schema)), "fresh_ms": 1e3 * fresh_s,
                     "hit_us": 1e6 * hit_s, "matcher_us": 1e6 * copy_s, "first_mask_us": 1e6 * first_s,
                     "mask_us": 1e6 * mask_s})
    return rows


def report(rows: list[dict], compile_rows: list[dict], args, console: Console) -> list[str]:
    console.print(harness.table(
        f"a. decode: {'embedded' if args.model is None else args.model} model, fp32, greedy, {args.prompt_len}-token "
        f"prompts, {args.steps} decode steps timed "
        f"(EOS ignored), constrained by a JSON string of exactly {args.string_length:,} characters (grammar from the "
        f"cache); median of {args.rounds} alternating round(s); x plain: per-round ratio to unconstrained, median",
        ["batch", "system", "decode step", "decode tok/s", "rounds tok/s", "x plain", "rounds x plain"],
        [[str(r["batch"]), r["system"], f"{r['step_ms']:.2f} ms", f"{r['tok_s']:,.0f}",
          f"{r['tok_s_range'][0]:,.0f}-{r['tok_s_range'][1]:,.0f}", f"{r['ratio']:.2f}x",
          f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}x"] for r in rows]))
    constrained = [r for r in rows if r["system"] == "constrained"]
    plain = {r["batch"]: r for r in rows if r["system"] == "unconstrained"}

    def per_step(r, key):
        return f"{1e3 * r[key] / r['steps']:.2f}"

    console.print(harness.table(
        "b. the mask per decode step, same runs (ms): mask_rows = fill + apply + rest (the bitmask's allocation, "
        "the masked rows' gather and write-back); advance after the sample is outside mask_rows",
        ["batch", "rows/step", "mask_rows", "us/row", "fill", "apply", "rest", "advance",
         "step - plain step", "share of step"],
        [[str(r["batch"]), f"{r['masked_rows'] / r['steps']:g}", per_step(r, "mask_s"),
          f"{1e6 * r['mask_s'] / r['masked_rows']:.0f}", per_step(r, "fill_s"), per_step(r, "apply_s"),
          f"{1e3 * (r['mask_s'] - r['fill_s'] - r['apply_s']) / r['steps']:.2f}", per_step(r, "advance_s"),
          f"{r['step_ms'] - plain[r['batch']]['step_ms']:.2f}",
          f"{(r['mask_s'] + r['advance_s']) / r['steps'] / (r['step_ms'] / 1e3):.0%}"] for r in constrained]))
    console.print(harness.table(
        f"c. compiling (GrammarCompiler.compile), median of {args.compile_rounds} (cache hits and copies: of "
        f"{10 * args.compile_rounds}); fresh: compile + a matcher; first mask: that matcher's first fill, beside "
        "the same fill again",
        ["schema", "JSON bytes", "fresh", "cache hit", "matcher copy", "first mask", "mask again"],
        [[r["schema"], f"{r['schema_bytes']:,}" if "schema_bytes" in r else "", f"{r['fresh_ms']:.2f} ms",
          f"{r['hit_us']:.1f} us" if "hit_us" in r else "", f"{r['matcher_us']:.1f} us" if "hit_us" in r else "",
          f"{r['first_mask_us']:.0f} us" if "hit_us" in r else "", f"{r['mask_us']:.0f} us" if "hit_us" in r else ""]
         for r in compile_rows]))
    at = next((r for r in constrained if r["batch"] == TARGET_BATCH), None)
    if at is None:
        return [f"target: constrained decode >= {TARGET}x unconstrained at batch {TARGET_BATCH}: not measured "
                f"(--batches {','.join(map(str, args.batches))})"]
    return [f"target: constrained decode >= {TARGET}x unconstrained at batch {TARGET_BATCH} with a cached grammar: "
            f"{at['ratio']:.2f}x (rounds {at['ratio_range'][0]:.2f}-{at['ratio_range'][1]:.2f}x) "
            f"{'MET' if at['ratio'] >= TARGET else 'NOT MET'}"]


def parser() -> OneLineParser:
    p = OneLineParser(prog="l13_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints, default="1,16", help="requests decoding at once (default 1,16)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run (default 32)")
    p.add_argument("--string-length", type=int, default=1000,
                   help="characters of the schema's one string field (default 1000): more than --steps tokens hold")
    p.add_argument("--rounds", type=int, default=5, help="alternating decode rounds (default 5)")
    p.add_argument("--compile-rounds", type=int, default=5, help="fresh compiles per schema (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="a checkpoint directory or a named model (smollm2); default: the embedded tiny "
                                   "model")
    p.add_argument("--json", metavar="PATH")
    return p


def planned(args, env: dict[str, str], measured_device: str) -> dict[str, str]:
    """What this command runs with today (tests/test_doc_measured.py): the CPU, fp32, the backend the engine
    picks, the thread count its command line sets."""
    out = {"device": "cpu", "dtype": "float32", "backend": harness.resolve_backend("auto", "cpu", torch.float32)}
    if "OMP_NUM_THREADS" in env:
        out["threads"] = env["OMP_NUM_THREADS"]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    console = Console(width=160)
    try:
        if min(args.prompt_len, args.steps, args.string_length, args.rounds, args.compile_rounds) <= 0:
            raise CourseError("sizes and rounds must be positive")
        conditions = harness.start("cpu", torch.float32)
        conditions.extra.update(model=args.model or "tiny", prompt=str(args.prompt_len), steps=str(args.steps),
                                string=str(args.string_length), rounds=str(args.rounds))
        console.print("[bold]L13 structured-output benchmark[/]: constrained against unconstrained decoding, the "
                      "mask per step, compiling")
        model_dir = resolve_model_dir(args.model, default_model_dir)
        tokenizer, cfg = load_tokenizer(model_dir), Qwen3Config.from_dir(model_dir)
        t0 = time.perf_counter()
        compiler = GrammarCompiler(tokenizer, cfg.vocab_size, frozenset(cfg.eos_token_ids))
        tokenizer_load_s = time.perf_counter() - t0
        model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
        rows, used = decode(model, compiler, tokenizer, args, console)
        compile_rows = compiling(compiler, tokenizer_load_s, args)
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    conditions.backend = ",".join(sorted(used))
    verdicts = report(rows, compile_rows, args, console)
    for line in verdicts:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"decode": rows, "compile": compile_rows, "targets": verdicts}, conditions,
                           console)


if __name__ == "__main__":
    main()

"""The course's engine against llama.cpp on the same weights in the same dtype: batch-1 decode and one prefill.

    OMP_NUM_THREADS=1 python scripts/benchmark/llamacpp_bench.py [--dtypes f32,bf16] [--q4] [--rounds 3]
        [--prompt-len 128] [--decode 64] [--prefill-len 512] [--threads 1] [--profile] [--json PATH]

Needs the real model (README: A real model) and the llamacpp extra (`pip install -e ".[llamacpp]"`: it builds
llama.cpp from source). Both engines run SmolLM2-135M-Instruct's weights: ours from the course's converted
checkpoint, llama.cpp from scripts/benchmark/gguf_export.py's F32 or BF16 file of the very same values; `--q4`
adds llama.cpp on the shipped Q4_1 file as a third row, labelled so (4-bit weights: not the same computation).

Per dtype and round, each engine, one thread, alternating (harness.alternate): a `--prompt-len` prompt (a fixed
English text's tokens, the same ids to both), then `--decode` greedy tokens one at a time, timed from the first
decode step to the last; then a `--prefill-len` prompt in one forward. Ours is L4's engine (the C++ paged kernel,
one request), twice: with the C++ decode ops (shared/cpu_ops.cpp, the default) and with torch's ops
(PAGED_COURSE_CPU_OPS=0, the baseline they replaced, in the same run); llama.cpp is llama-cpp-python's `Llama.eval` with argmax over its logits, and its own timings
(the time inside its llama_decode call) beside the wall time. Reported: medians over rounds, tokens/s,
ours / llama.cpp, the share of the memory floor (the weights read once per token at the DRAM read rate this box
measures), and how many greedy tokens the two agree on (same weights; different kernels may round differently).
Targets (a benchmark, not a test): batch-1 decode at least 1.0x llama.cpp's in the same dtype, at 85% of the
memory floor or more.
`--profile`: one more decode of ours under cProfile, split by the engine's seams (profile_l4.py's table).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's lessons/ and shared/, not an installed course's
import harness  # noqa: E402
from gguf_export import exported  # noqa: E402
from lessons.l4_continuous import L4Engine  # noqa: E402
from shared import cpu_ops  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.named_models import NAMED, gguf_path  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

DECODE_TARGET = 1.0  # ours / llama.cpp batch-1 decode tokens/s, same dtype
FLOOR_TARGET = 0.85  # ours: the share of the memory floor
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
TEXT = ("Paged attention stores each request's keys and values in fixed-size blocks of a shared pool, the way an "
        "operating system stores a process's memory in pages. A block table maps each request's token positions "
        "to the blocks that hold them, so a request grows one block at a time and frees every block when it "
        "finishes, and no memory is reserved for tokens that are never generated. The attention kernel reads the "
        "keys and values through the table. Two requests that begin with the same system prompt can point at the "
        "same blocks, and a request that must wait can give its blocks back and recompute them later. ")


@dataclass
class Timing:
    decode_s: list[float] = field(default_factory=list)  # wall seconds for the decode tokens, per round
    own_decode_s: list[float] = field(default_factory=list)  # llama.cpp's own time in llama_decode
    prefill_s: list[float] = field(default_factory=list)
    own_prefill_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the greedy tokens of the last round (prefill's + decode's)


class Ours:
    """L4's engine on the course's checkpoint: one request at a time."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, blocks: int, cpu_ops: bool = True):
        self.model = Qwen3ForCausalLM.from_dir(model_dir, dtype, torch.device("cpu"))
        self.engine = L4Engine(self.model, 16, blocks, 1, "auto")
        self.cpu_ops = cpu_ops
        self.label = "ours (L4)" if cpu_ops else "ours (L4), torch's ops"

    def decode(self, prompt: list[int], n: int, timing: Timing) -> None:
        with ops_switched(self.cpu_ops):
            self._decode(prompt, n, timing)

    def prefill(self, prompt: list[int], timing: Timing) -> None:
        with ops_switched(self.cpu_ops):
            self._prefill(prompt, timing)

    def _decode(self, prompt: list[int], n: int, timing: Timing) -> None:
        seq = self.engine.add_request(prompt, StopRule(n + 1, frozenset(), ignore_eos=True))
        self.engine.step()  # the prompt, and the first token
        t0 = time.perf_counter()
        while self.engine.scheduler.has_work():
            self.engine.step()
        timing.decode_s.append(time.perf_counter() - t0)
        timing.tokens = list(seq.output_ids)

    def _prefill(self, prompt: list[int], timing: Timing) -> None:
        self.engine.add_request(prompt, StopRule(1, frozenset(), ignore_eos=True))
        t0 = time.perf_counter()
        self.engine.step()
        timing.prefill_s.append(time.perf_counter() - t0)


class LlamaCpp:
    """llama-cpp-python's Llama on a GGUF file: eval the prompt, then argmax and eval one token at a time."""

    def __init__(self, path: Path, threads: int, n_ctx: int, label: str):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        self.label = label
        self.in_decode = 0.0  # seconds inside llama_decode itself: llama.cpp's work, without the Python around it
        context, decode = self.llm._ctx, self.llm._ctx.decode

        def timed(batch) -> None:  # llama_perf_context reads zeros through this binding: time the C call here
            t0 = time.perf_counter()
            decode(batch)
            self.in_decode += time.perf_counter() - t0

        context.decode = timed

    def greedy(self) -> int:
        """Argmax of the last evaluated token's logits, read in place (this binding's eval no longer copies them)."""
        import numpy as np

        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).argmax())

    def decode(self, prompt: list[int], n: int, timing: Timing) -> None:
        self.llm.reset()
        self.llm.eval(prompt)
        tokens = [self.greedy()]
        self.in_decode = 0.0
        t0 = time.perf_counter()
        for _ in range(n):
            self.llm.eval([tokens[-1]])
            tokens.append(self.greedy())
        timing.decode_s.append(time.perf_counter() - t0)
        timing.own_decode_s.append(self.in_decode)
        timing.tokens = tokens

    def prefill(self, prompt: list[int], timing: Timing) -> None:
        self.llm.reset()
        self.in_decode = 0.0
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        self.greedy()
        timing.prefill_s.append(time.perf_counter() - t0)
        timing.own_prefill_s.append(self.in_decode)


@contextmanager
def ops_switched(on: bool) -> Iterator[None]:
    """The C++ decode ops on or off (shared/cpu_ops.py reads $PAGED_COURSE_CPU_OPS at every call) for one run."""
    before = os.environ.get(cpu_ops.ENABLE_VAR)
    os.environ[cpu_ops.ENABLE_VAR] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[cpu_ops.ENABLE_VAR]
        else:
            os.environ[cpu_ops.ENABLE_VAR] = before


def prompt_ids(model_dir: Path, n: int) -> list[int]:
    ids: list[int] = []
    tokenizer = load_tokenizer(model_dir)
    while len(ids) < n:
        ids += tokenizer.encode(TEXT).ids
    return ids[:n]


def weight_bytes(model: Qwen3ForCausalLM) -> int:
    """What one decode step reads at least: every weight once (the tied embedding once, as the LM head)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed_tokens" not in name) \
        + model.lm_head.weight.numel() * model.lm_head.weight.element_size()


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def agree(a: list[int], b: list[int]) -> int:
    """Greedy tokens equal before the first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def profile_decode(ours: Ours, prompt: list[int], n: int, console: Console) -> None:
    import profile_l4

    profiler = cProfile.Profile()
    seq = ours.engine.add_request(prompt, StopRule(n + 1, frozenset(), ignore_eos=True))
    ours.engine.step()
    t0 = time.perf_counter()
    profiler.enable()
    while ours.engine.scheduler.has_work():
        ours.engine.step()
    profiler.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(profiler)
    seconds = {k: profile_l4.cumulative(stats, f, name) for k, (f, name) in profile_l4.SEAMS.items()}
    console.print(harness.table(
        f"ours, one decode step ({len(seq.output_ids) - 1} steps under cProfile, {1e3 * wall / n:.2f} ms each)",
        ("where", "ms per step", "share"),
        [[label, f"{1e3 * s / n:.3f}", f"{100 * s / wall:.0f}%"] for label, s in profile_l4.rows(seconds)]))


def planned(args, env: dict[str, str], measured_device: str) -> dict[str, str]:
    """What this command's conditions line says today (tests/test_doc_measured.py): the CPU, the dtypes asked
    for, our engine's attention backend (`auto`), the thread count."""
    return {"device": "cpu", "dtype": args.dtypes.replace(",", "/"), "threads": str(args.threads),
            "backend": harness.resolve_backend("auto", "cpu", torch.float32)}


def parser() -> OneLineParser:
    p = OneLineParser(prog="llamacpp_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="f32,bf16", help="comma-separated: f32, bf16 (default: both)")
    p.add_argument("--q4", action="store_true", help="also llama.cpp on the shipped Q4_1 file (a third row)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128, help="the prompt before the decode (default: 128)")
    p.add_argument("--decode", type=int, default=64, help="greedy tokens decoded one at a time (default: 64)")
    p.add_argument("--prefill-len", type=int, default=512, help="one prompt in one forward (default: 512)")
    p.add_argument("--threads", type=int, default=1, help="torch's and llama.cpp's threads (default: 1)")
    p.add_argument("--profile", action="store_true", help="then one decode of ours under cProfile, by seam")
    p.add_argument("--json", metavar="PATH")
    return p


def check(args) -> list[str]:
    dtypes = args.dtypes.split(",")
    bad = [d for d in dtypes if d not in TORCH_DTYPES]
    if bad or not dtypes:
        raise CourseError(f"--dtypes {args.dtypes!r}: use f32, bf16 or both")
    for name in ("rounds", "prompt_len", "decode", "prefill_len", "threads"):
        if getattr(args, name) < 1:
            raise CourseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.prompt_len + args.decode + 1 > 2048 or args.prefill_len > 2048:
        raise CourseError("--prompt-len + --decode and --prefill-len must each fit 2,048 tokens")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise CourseError('llama.cpp is the llamacpp extra: pip install -e ".[llamacpp]" (it builds llama.cpp from '
                          'source: minutes)') from None
    return dtypes


def main() -> None:
    args = parser().parse_args()
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        dtypes = check(args)
        torch.set_num_threads(args.threads)
        model_dir = resolve_model_dir("smollm2", default_model_dir)
        files = {d: exported(d) for d in dtypes}
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    n_ctx = 2048
    blocks = n_ctx // 16 + 1
    prompt, long_prompt = prompt_ids(model_dir, args.prompt_len), prompt_ids(model_dir, args.prefill_len)
    engines: dict[str, list] = {}
    for d in dtypes:
        engines[d] = [Ours(model_dir, TORCH_DTYPES[d], blocks), Ours(model_dir, TORCH_DTYPES[d], blocks, cpu_ops=False),
                      LlamaCpp(files[d], args.threads, n_ctx, f"llama.cpp ({d.upper()} GGUF)")]
    if args.q4:
        engines["q4_1"] = [LlamaCpp(gguf_path(NAMED["smollm2"]), args.threads, n_ctx, "llama.cpp (Q4_1 GGUF)")]
    conditions = harness.start("cpu", "/".join(dtypes), backend=harness.backend_name(engines[dtypes[0]][0].engine),
                               threads=args.threads, code=["scripts/benchmark/gguf_export.py"])
    import llama_cpp

    conditions.extra.update({"model": "smollm2 (SmolLM2-135M-Instruct)", "llama-cpp-python": llama_cpp.__version__,
                             "workload": f"{args.prompt_len}-token prompt then {args.decode} greedy tokens; a "
                                         f"{args.prefill_len}-token prefill; {args.rounds} rounds alternating"})
    systems = [(d, e) for d, pair in engines.items() for e in pair]
    timings = {id(e): Timing() for _, e in systems}
    t0 = time.perf_counter()
    for r, (d, engine) in harness.alternate(systems, args.rounds):
        engine.decode(prompt, args.decode, timings[id(engine)])
        engine.prefill(long_prompt, timings[id(engine)])
        t = timings[id(engine)]
        console.print(f"  round {r + 1}: {engine.label}, {d}: decode {1e3 * t.decode_s[-1] / args.decode:.2f} "
                      f"ms/token, prefill {t.prefill_s[-1]:.2f} s", highlight=False)
    floor_gbs = memory_bandwidth()
    rows, report = [], []
    for d, pair in engines.items():
        weights = None if d == "q4_1" else weight_bytes(pair[0].model)  # the 4-bit row has no floor of ours
        first = timings[id(pair[0])]
        for engine in pair:
            t = timings[id(engine)]
            decode = args.decode / median(t.decode_s)
            own = args.decode / median(t.own_decode_s) if t.own_decode_s else None
            prefill = args.prefill_len / median(t.prefill_s)
            base = next((timings[id(e)] for e in pair if isinstance(e, LlamaCpp)), None)
            vs = (decode / (args.decode / median(base.decode_s)) if isinstance(engine, Ours) and base else None)
            vs_prefill = (prefill / (args.prefill_len / median(base.prefill_s))
                          if isinstance(engine, Ours) and base else None)
            floor = None if weights is None else weights / floor_gbs / 1e9 * decode
            same = agree(t.tokens, first.tokens) if isinstance(engine, LlamaCpp) and d != "q4_1" else None
            rows.append([engine.label, d, harness.fmt(decode), harness.fmt(own), harness.fmt(vs, "x", 2),
                         harness.fmt(None if floor is None else 100 * floor, "%", 0), harness.fmt(prefill, digits=0),
                         harness.fmt(vs_prefill, "x", 2),
                         "-" if same is None else f"{same} of {len(first.tokens)}"])
            report.append({"engine": engine.label, "dtype": d, "decode_tok_s": decode, "own_decode_tok_s": own,
                           "decode_x": vs, "floor_share": floor, "prefill_tok_s": prefill, "prefill_x": vs_prefill,
                           "agree": same, "decode_s": t.decode_s, "prefill_s": t.prefill_s,
                           "own_decode_s": t.own_decode_s, "own_prefill_s": t.own_prefill_s, "tokens": t.tokens})
    console.print(harness.table(
        f"batch-1 decode after {args.prompt_len} tokens and a {args.prefill_len}-token prefill, medians of "
        f"{args.rounds} rounds", ("engine", "dtype", "decode tok/s", "own clock", "ours / llama.cpp",
                                  "memory floor", "prefill tok/s", "ours / llama.cpp", "greedy tokens equal"), rows))
    console.print(f"  own clock: the tokens/s of llama.cpp's time inside llama_decode alone (no Python around it); "
                  f"memory floor: every weight read once per token at {floor_gbs:.1f} GB/s (a 1 GiB buffer summed); "
                  "greedy tokens equal: "
                  "llama.cpp's first difference from ours (the prefill's token and the decode's)", highlight=False)
    met = {r["dtype"]: r["decode_x"] >= DECODE_TARGET and r["floor_share"] >= FLOOR_TARGET
           for r in report if r["engine"] == "ours (L4)" and r["decode_x"] is not None}
    console.print(f"target {'[green]met[/]' if met and all(met.values()) else '[red]not met[/]'} (batch-1 decode "
                  f"≥ {DECODE_TARGET}x llama.cpp's in the same dtype, at ≥ {FLOOR_TARGET:.0%} of the memory floor): "
                  + ", ".join(f"{d} {'met' if ok else 'not met'}" for d, ok in met.items()))
    if args.profile:
        profile_decode(engines[dtypes[0]][0], prompt, args.decode, console)
    console.print(f"wall time {time.perf_counter() - t0:.0f} s")
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"rows": report, "memory_gb_s": floor_gbs}, conditions, console)


def memory_bandwidth() -> float:
    """GB/s one thread streams from DRAM (attention_bench.py's measure, a 1 GiB buffer summed)."""
    from attention_bench import DRAM_BYTES, read_rate

    return read_rate(DRAM_BYTES) / 1e9


if __name__ == "__main__":
    main()

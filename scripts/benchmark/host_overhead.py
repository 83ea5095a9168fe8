"""Host work per decode step against history length: does an engine's bookkeeping grow with the tokens
each request has already seen?

    OMP_NUM_THREADS=1 python scripts/benchmark/host_overhead.py                  # L4, L6, L8, L10 --tp 2
    OMP_NUM_THREADS=1 python scripts/benchmark/host_overhead.py --lessons l4,l8 --histories 1024,8192

Host time, per step: the wall time of the engine's own `step()` minus the time spent inside the model's
compute, which this script times by wrapping `model.forward` (every layer: matmuls, attention, KV writes)
and `model.logits` (the vocabulary projection) with perf_counter. What is left is everything the engine
does on the host around the model: scheduling, slices, batch metadata (page tables to tensors), the
backend's plan(), input ids, sampling, postprocessing, and (L10) packing and sending the step to the
other ranks. For L10 the followers' own host work (unpacking, their metadata) happens while rank 0 waits
inside the forward's first all-reduce, so it is counted in the forward there; the table's `ints sent`
column shows what that work is proportional to, and the followers' receive path is also replayed in
this process from rank 0's real messages (`follower host`).

The state is built cheaply, not prefilled: prefilling 32 requests of 32k tokens would take far longer
than the decode steps measured. Each request gets its prompt (history + i tokens for request i, so their
block boundaries fall on different steps), its blocks from the engine's own allocator, num_cached set
as if the prompt had been computed, and one sampled token; the prompt's K/V is whatever the pool holds
(zeros), and (L6 on) the prompt's blocks are marked offered to the prefix cache without registering
them. The steps timed are then the real engine's `step()`: the scheduler, the runner, the model, the
sampler, exactly as a server's decode steps run them.

Two parts. First, the flatness: histories of 1k, 8k and 32k tokens with 32 requests decoding, on the
embedded tiny model (its context is raised past 4,096 positions for this; RoPE takes any position), whose
K/V is 4 KiB a token in fp32: 32 x 32k tokens = 4 GiB, which this machine holds. Second, the host share
of the step at batch 32 on the benchmark shape (bench_systems.BENCH_SHAPE, 12 KiB of K/V a token in
fp32), at histories it can hold (1k and 4k: 384 MiB and 1.5 GiB). Not a test: tests never time.
"""
from __future__ import annotations

import gc
import importlib
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import harness  # noqa: E402
from bench_systems import bench_shape_dir  # noqa: E402
from lessons.l2_token_flat.engine import blocks_for  # noqa: E402
from lessons.l4_continuous.sequence import Status  # noqa: E402
from shared.cli import OneLineParser, resolve_dtype  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

LESSONS = ("l4", "l6", "l8", "l10")
BATCH = 32
BLOCK_SIZE = 16
DEFINITION = ("host time = wall time of engine.step() minus the time inside model.forward (every layer), "
              "model.logits (the vocabulary projection) and sample() (one argmax over [32, vocab] here), each timed "
              "with perf_counter by wrapping it in this script")


SAMPLERS = ("lessons.l4_continuous.engine", "lessons.l6_prefix_sharing.engine", "lessons.l8_chunked_prefill.engine")


class ComputeClock:
    """Wraps a model's forward and logits, and the engines' sampler; `seconds` is the time spent inside them."""

    def __init__(self, model: torch.nn.Module):
        self.seconds = 0.0
        for name in ("forward", "logits"):
            setattr(model, name, self.timed(getattr(model, name)))
        self.samplers = [(m, m.sample) for m in map(importlib.import_module, SAMPLERS)]
        for module, fn in self.samplers:
            module.sample = self.timed(fn)

    def close(self) -> None:
        for module, fn in self.samplers:
            module.sample = fn

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def kv_bytes_per_token(model: Qwen3ForCausalLM) -> int:
    cfg = model.config
    return 2 * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers * model.lm_head.weight.element_size()


def long_context(model: Qwen3ForCausalLM, tokens: int) -> Qwen3ForCausalLM:
    """Let the engine accept prompts past the checkpoint's context (its RoPE has no table to outgrow)."""
    if tokens > model.config.max_position_embeddings:
        model.config = replace(model.config, max_position_embeddings=tokens)
    return model


def make_engine(lesson: str, model, num_blocks: int, backend: str, group=None):
    if lesson == "l4":
        from lessons.l4_continuous import L4Engine
        return L4Engine(model, BLOCK_SIZE, num_blocks, BATCH, backend)
    if lesson == "l6":
        from lessons.l6_prefix_sharing import L6Engine
        return L6Engine(model, BLOCK_SIZE, num_blocks, BATCH, backend)
    if lesson == "l8":
        from lessons.l8_chunked_prefill import L8Engine
        return L8Engine(model, BLOCK_SIZE, num_blocks, BATCH, backend)
    from lessons.l10_tensor_parallel import L10Engine
    return L10Engine(model, BLOCK_SIZE, num_blocks, BATCH, backend)


def fake_prefill(engine, history: int, steps: int, vocab: int, seed: int) -> list:
    """32 requests decoding after histories of history + i tokens, their prompts 'computed' (see the docstring)."""
    rng = random.Random(seed)
    top = min(vocab, 151643)
    seqs = []
    for i in range(BATCH):
        prompt = [rng.randrange(top) for _ in range(history + i)]
        seq = engine.add_request(prompt, StopRule(steps + 2, frozenset(), ignore_eos=True))
        engine.scheduler.waiting.remove(seq)
        seq.num_cached = len(prompt)
        seq.output_ids.append(rng.randrange(top))  # the token the prefill would have sampled
        seq.reserve(seq.num_tokens, engine.allocator)
        if hasattr(engine.scheduler, "register_written"):  # L6 on: the chain keys a prefill computes
            full = seq.num_cached // BLOCK_SIZE
            engine.scheduler.keys(seq, full)
            seq.extra["registered"] = full  # offered to the cache, not registered
        if hasattr(engine, "timing"):  # L8 on: the request's token times
            engine.timing[seq.seq_id].stamp(engine.clock, time.perf_counter())
        seq.status, seq.admitted_at = Status.RUNNING, engine.scheduler.step_no
        engine.scheduler.running.append(seq)
        seqs.append(seq)
    return seqs


def measure(engine, clock: ComputeClock, warmup: int, steps: int, group=None) -> dict:
    """Run warmup + steps real engine steps; per timed step its wall and host seconds (and, for L10, the
    seconds rank 0 spent sending the step to the followers, which the host seconds include)."""
    walls, hosts, sends = [], [], []
    for k in range(warmup + steps):
        c0, s0, t0 = clock.seconds, group.seconds["broadcast"] if group else 0.0, time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        if k >= warmup:
            walls.append(wall)
            hosts.append(wall - (clock.seconds - c0))
            sends.append((group.seconds["broadcast"] - s0) if group else 0.0)
    return {"step_ms": 1e3 * p50(walls), "host_ms": 1e3 * p50(hosts), "host_max_ms": 1e3 * max(hosts),
            "send_ms": 1e3 * p50(sends) if group else None}


def p50(values: list[float]) -> float:
    return harness.percentiles(values, (50,))["p50"]


class WireMeter:
    """L10: counts the int64s rank 0 packs for each step, and keeps the messages to replay a follower's side."""

    def __init__(self):
        from lessons.l10_tensor_parallel import wire
        self.wire, self.pack, self.messages = wire, wire.pack, []
        wire.pack = self.counted

    def counted(self, kind, *args):
        header, payload = self.pack(kind, *args)
        if kind == "run_step":
            self.messages.append((header, payload))
        return header, payload

    def close(self) -> None:
        self.wire.pack = self.pack


def follower_replay(messages: list) -> float:
    """Median ms per step of a follower's host path (unpack, its table copy, the step's metadata), replayed
    from rank 0's messages in order, without the forward."""
    from lessons.l10_tensor_parallel import wire
    from lessons.l3_block_tensor.batch_meta import BatchMeta

    try:
        from lessons.l10_tensor_parallel.tables import KeptTables
        join = KeptTables().join
    except ImportError:  # before the tables were sent as changes, a slice arrived with its whole table
        def join(slices):
            return slices
    times = []
    for header, payload in messages:
        t0 = time.perf_counter()
        _kind, slices, _copies = wire.unpack(header, payload)
        BatchMeta.build(join(slices), BLOCK_SIZE, torch.device("cpu"))
        times.append(time.perf_counter() - t0)
    return 1e3 * p50(times[len(times) // 4:])


def run_lesson(lesson: str, model_dir: Path, dtype: torch.dtype, history: int, args, group=None) -> dict:
    if lesson == "l10":
        from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM
        model = TpQwen3ForCausalLM.load(model_dir, dtype, group)
    else:
        model = Qwen3ForCausalLM.from_dir(model_dir, dtype, torch.device("cpu"))
    long_context(model, history + BATCH + args.steps + 8)
    clock = ComputeClock(model)
    steps = args.warmup + args.steps
    num_blocks = BATCH * (blocks_for(history + BATCH + steps + 2, BLOCK_SIZE) + 1)
    meter = WireMeter() if lesson == "l10" else None
    try:
        engine = make_engine(lesson, model, num_blocks, args.backend)
        fake_prefill(engine, history, steps, model.config.vocab_size, args.seed)
        with torch.inference_mode():
            row = measure(engine, clock, args.warmup, args.steps, group if lesson == "l10" else None)
        row["backend"] = engine.runner.backend.name
        if meter is not None:
            row["ints_sent"] = int(p50([int(h[2]) for h, _ in meter.messages[args.warmup:]]))
            row["follower_ms"] = follower_replay(meter.messages)
    finally:
        clock.close()
        if meter is not None:
            meter.close()
    del engine, model
    gc.collect()
    return row


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise CourseError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise CourseError(f"{flag} values must be at least 1, got {text!r}")
    return values


def parser() -> OneLineParser:
    p = OneLineParser(prog="host_overhead.py", description=__doc__)
    p.add_argument("--lessons", default=",".join(LESSONS), help=f"comma-separated, of {', '.join(LESSONS)}")
    p.add_argument("--histories", default="1024,8192,32768", help="tokens per request before the steps timed")
    p.add_argument("--share-histories", default="1024,4096", help="histories for the bench-shape share ('' skips)")
    p.add_argument("--steps", type=int, default=16, help="steps timed per point (16: every request crosses "
                   "one block boundary)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tp", type=int, default=2, help="L10's ranks")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    return p


def main() -> None:
    args = parser().parse_args()
    try:
        lessons = [x.strip() for x in args.lessons.split(",") if x.strip()]
        bad = [x for x in lessons if x not in LESSONS]
        if bad or not lessons:
            named = bad[0] if bad else args.lessons
            raise CourseError(f"--lessons: unknown lesson {named!r}; use {', '.join(LESSONS)}")
        histories = parse_ints(args.histories, "--histories")
        shares = parse_ints(args.share_histories, "--share-histories") if args.share_histories else []
        if args.steps < 1 or args.warmup < 0 or args.threads < 1 or args.tp < 1:
            raise CourseError("--steps, --threads and --tp must be at least 1, --warmup at least 0")
        dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    torch.set_num_threads(args.threads)
    console = Console(width=150)  # the table's ten columns, unwrapped
    conditions = harness.start("cpu", dtype, threads=args.threads)
    used = set()  # the backends the engines really used
    console.print(f"[bold]{DEFINITION}[/]")
    tiny = default_model_dir()
    group = None
    if "l10" in lessons:
        from lessons.l10_tensor_parallel.launch import start
        group = start(args.tp, torch.device("cpu"))
    try:
        parts = [("tiny (embedded)", tiny, histories, lessons)]
        share_lessons = [x for x in lessons if x in ("l4", "l8")]
        if shares and share_lessons:  # no empty table when only L6 / L10 were asked for
            parts.append(("bench shape", bench_shape_dir(), shares, share_lessons))
        for name, model_dir, hs, which in parts:
            probe = Qwen3ForCausalLM.from_dir(model_dir, dtype, torch.device("cpu"))
            per_token = kv_bytes_per_token(probe)
            cfg = probe.config
            del probe
            console.print(f"\n{name}: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
                          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, vocab {cfg.vocab_size}, "
                          f"{str(dtype).removeprefix('torch.')}: K/V {per_token / 1024:g} KiB a token; "
                          + ", ".join(f"{BATCH} x {h} tokens = {BATCH * h * per_token / 2**30:.2f} GiB" for h in hs))
            cells = []
            for lesson in which:
                base = None
                for h in hs:
                    row = run_lesson(lesson, model_dir, dtype, h, args, group)
                    base = base or row["host_ms"]
                    label = f"l10 --tp {args.tp}" if lesson == "l10" else lesson
                    used.add(row["backend"])
                    cells.append([label, str(h), row["backend"], f"{row['step_ms']:.2f}",
                                  f"{row['host_ms']:.3f} ({row['host_ms'] / base:.2f}x)",
                                  f"{100 * row['host_ms'] / row['step_ms']:.1f}%", f"{row['host_max_ms']:.3f}",
                                  "" if row["send_ms"] is None else f"{row['send_ms']:.3f}",
                                  str(row.get("ints_sent", "")),
                                  "" if row.get("follower_ms") is None else f"{row['follower_ms']:.3f}"])
                    console.print(f"  {label} history {h}: host {row['host_ms']:.3f} ms of {row['step_ms']:.2f} ms"
                                  + ("" if row["send_ms"] is None else f" (send {row['send_ms']:.3f} ms, "
                                     f"{row['ints_sent']} ints; follower {row['follower_ms']:.3f} ms)"))
            console.print(harness.table(
                f"{name}: {BATCH} requests decoding, block size {BLOCK_SIZE}, median of {args.steps} steps after "
                f"{args.warmup}", ("lesson", "history", "backend", "step ms", "host ms", "host share", "host max ms",
                                   "of which send ms", "ints sent", "follower host ms"), cells))
    finally:
        if group is not None:
            group.close()
    conditions.backend = ",".join(sorted(used)) or "none"
    if "l10" in lessons:
        conditions.extra["tp"] = str(args.tp)
    harness.finish(conditions, console)


if __name__ == "__main__":
    main()

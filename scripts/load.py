"""A load generator for any OpenAI-compatible server: seeded prompts, streamed completions, latency percentiles.

    python scripts/load.py [--url http://127.0.0.1:8000/v1] [--model NAME] [--endpoint chat|completions]
        [--num-requests 64] [--concurrency 8] [--request-rate inf] [--arrivals poisson|fixed]
        [--input-len 32-256] [--output-len 16-64] [--seed 0] [--ignore-eos [--ignore-eos-field ...]]
        [--goodput-ttft-ms MS] [--goodput-tpot-ms MS] [--timeout 600] [--json PATH]

It talks to the server through the official `openai` client (one shared AsyncOpenAI, no retries), so what it
measures is what a user of that client sees. Without --model it asks GET /v1/models and uses the first id.

The workload is a function of --seed alone: request i gets a prompt of `input` words drawn from a fixed list of
short English words (about one token each, so the prompt is roughly `input` tokens; the server's own count,
from usage, is what the report shows), and asks for exactly `output` tokens (max_tokens, temperature 0). With
--ignore-eos the request also asks the server not to stop at end-of-sequence, so every request produces its
full length. Servers spell that differently: vLLM, SGLang and this course's server take `"ignore_eos": true`;
`transformers serve` rejects unknown fields with 422, and takes `--ignore-eos-field generation_config`, which
sends a generation config whose eos_token_id is -1 (no token ends the sequence); llama-cpp-python's server takes
`--ignore-eos-field min_tokens` (vLLM's field too: end-of-sequence masked until max_tokens), sent with
`repeat_penalty` 1.0, since its default of 1.1 would make temperature 0 something other than greedy.

Arrivals: request i is released at its arrival time (all at once with the default --request-rate inf; else gaps
of exactly 1/rate with --arrivals fixed, or exponential gaps of mean 1/rate with poisson), then waits for one of
--concurrency slots. Its clock starts when it is sent, after it gets a slot.

Every request streams with stream_options.include_usage, and is timed on the client:
  TTFT  time from sending to the first chunk that carries generated text;
  ITL   the gaps between successive chunks that carry text (a server that packs several tokens into one chunk
        shows fewer, longer gaps);
  TPOT  (E2EL - TTFT) / (output tokens - 1), per request;
  E2EL  time from sending to the end of the stream.
Output tokens come from the usage the server reports at the end of the stream; a server that reports none has
its text chunks counted instead (the report says which). Goodput: completed requests per second that met every
--goodput-* bound given.

Exit status 0 when every request completed, 1 when any failed (each failure is counted and the first error is
shown), 2 for a bad option or a server whose model list cannot be read.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmark"))

import harness  # noqa: E402  (percentiles and tables shared with the benchmarks)
from shared.cli import OneLineParser  # noqa: E402

ENDPOINTS = ("chat", "completions")
ARRIVALS = ("poisson", "fixed")
EOS_FIELDS = ("ignore_eos", "generation_config", "min_tokens")
# Common short words: with a leading space each is one token in Qwen's (and most BPE) vocabularies.
WORDS = tuple("""the of and to in is it you that he was for on are as with his they at be this have from or one
had by word but not what all were we when your can said there use an each which she do how their if will up
other about out many then them these so some her would make like him into time has look two more write go see
number no way could people my than first water been call who oil its now find long down day did get come made
may part over new sound take only little work know place year live me back give most very after thing our just
name good sentence man think say great where help through much before line right too mean old any same tell boy
follow came want show also around form three small set put end does another well large must big even such
because turn here why ask went men read need land different home us move try kind hand picture again change off
play spell air away animal house point page letter mother answer found study still learn should world high""".split())


class LoadError(Exception):
    """Options or a server the run cannot start with: the CLI prints it as one line, exit status 2."""


@dataclass(frozen=True)
class LoadSpec:
    """What to send: everything that decides the workload and how it is paced."""
    num_requests: int = 64
    concurrency: int = 8
    request_rate: float = math.inf  # requests per second; inf: every request is released at once
    arrivals: str = "poisson"
    input_len: tuple[int, int] = (32, 256)  # prompt words, uniform over [MIN, MAX]
    output_len: tuple[int, int] = (16, 64)  # max_tokens, uniform over [MIN, MAX]
    seed: int = 0
    endpoint: str = "chat"
    ignore_eos: bool = False
    ignore_eos_field: str = "ignore_eos"
    timeout: float = 600.0  # seconds per request

    def check(self) -> None:
        """Every value the run depends on, as LoadError with the option's name."""
        for name in ("num_requests", "concurrency"):
            if getattr(self, name) < 1:
                raise LoadError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.request_rate > 0:  # also rejects nan
            raise LoadError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if not self.timeout > 0:
            raise LoadError(f"--timeout must be positive, got {self.timeout}")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise LoadError(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo}-{hi}")
        for name, value, allowed in (("endpoint", self.endpoint, ENDPOINTS), ("arrivals", self.arrivals, ARRIVALS),
                                     ("ignore-eos-field", self.ignore_eos_field, EOS_FIELDS)):
            if value not in allowed:
                raise LoadError(f"--{name} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class Job:
    """One request of the workload, before it is sent."""
    index: int
    prompt: str
    input_words: int
    max_tokens: int
    arrival_s: float  # release time, seconds after the run starts


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; `sent_s` counts from the start of the run, the others
    from the moment the request was sent."""
    index: int
    input_words: int
    max_tokens: int
    arrival_s: float
    sent_s: float = 0.0
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2el_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    prompt_tokens: int | None = None  # the server's count, from usage
    output_tokens: int = 0
    token_source: str = "chunks"  # "usage" when the server reported usage, else "chunks"
    finish_reason: str | None = None
    text: str = ""

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; undefined for fewer than two tokens."""
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LoadResult:
    spec: LoadSpec
    url: str
    model: str
    records: list[RequestRecord]
    duration_s: float  # from the first release to the end of the last request


# ----- the workload -----

def parse_range(text: str, name: str) -> tuple[int, int]:
    """"MIN-MAX" or a single "N" (MIN = MAX = N)."""
    parts = text.split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise LoadError(f"--{name} {text!r}: use MIN-MAX or N, e.g. 32-256") from None
    if len(parts) > 2:
        raise LoadError(f"--{name} {text!r}: use MIN-MAX or N, e.g. 32-256")
    return lo, hi


def arrival_offsets(n: int, rate: float, arrivals: str, rng: random.Random) -> list[float]:
    """Release times of n requests, the first at 0: gaps of 1/rate (fixed) or exponential of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    if arrivals == "fixed":
        return [i / rate for i in range(n)]  # i / rate, not a running sum: no rounding drift over many requests
    offsets, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def make_workload(spec: LoadSpec) -> list[Job]:
    """The requests `spec` describes; equal specs give equal workloads. Arrivals draw from a generator of their
    own, so changing the rate or the arrival process never changes a prompt or a length."""
    rng = random.Random(spec.seed)
    lengths = [(rng.randint(*spec.input_len), rng.randint(*spec.output_len)) for _ in range(spec.num_requests)]
    prompts = [" ".join(rng.choice(WORDS) for _ in range(n_in)) for n_in, _ in lengths]
    times = arrival_offsets(spec.num_requests, spec.request_rate, spec.arrivals, random.Random(f"arrivals-{spec.seed}"))
    return [Job(i, p, n_in, n_out, t) for i, (p, (n_in, n_out), t) in enumerate(zip(prompts, lengths, times))]


def extra_body(spec: LoadSpec, max_tokens: int = 0) -> dict | None:
    """The non-OpenAI fields of a request for `max_tokens`: how to ask the server not to stop at end-of-sequence."""
    if not spec.ignore_eos:
        return None
    if spec.ignore_eos_field == "generation_config":  # transformers serve: a JSON string replacing its defaults
        return {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
    if spec.ignore_eos_field == "min_tokens":  # llama-cpp-python's server: end-of-sequence masked until then;
        return {"min_tokens": max_tokens, "repeat_penalty": 1.0}  # its default, 1.1, is not greedy
    return {"ignore_eos": True}


# ----- sending -----

def describe_error(e: BaseException) -> str:
    """One line: the HTTP status and the server's message when there is one."""
    import openai

    if isinstance(e, openai.APIStatusError):  # the client's message is only "Error code: N": add the server's
        body = e.body
        if isinstance(body, dict):  # OpenAI's {"message": ...} (the client unwraps "error"), FastAPI's "detail"
            body = body.get("message") or body.get("detail") or body.get("error") or body
        return f"HTTP {e.status_code}: {body}" if body else f"HTTP {e.status_code}"
    if isinstance(e, openai.APITimeoutError):
        return "timed out"
    if isinstance(e, openai.APIError) and isinstance(e.body, str):  # an error event inside the stream
        return f"{e.message}: {e.body}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def chunk_text(chunk, endpoint: str) -> tuple[str, str | None]:
    """The generated text a streamed chunk carries (reasoning text counts: it is generated tokens too) and its
    finish reason, if any."""
    text, finish = "", None
    for choice in chunk.choices:
        if endpoint == "chat":
            delta = choice.delta
            text += (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
        else:
            text += choice.text or ""
        finish = choice.finish_reason or finish
    return text, finish


async def send(client, spec: LoadSpec, model: str, job: Job, record: RequestRecord, t0: float) -> None:
    """Stream one request into `record`; a failure is recorded, never raised."""
    kwargs = dict(model=model, max_tokens=job.max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra_body(spec, job.max_tokens),
                  timeout=spec.timeout)
    start = time.perf_counter()
    record.sent_s = start - t0
    try:
        if spec.endpoint == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": job.prompt}], **kwargs)
        else:
            stream = await client.completions.create(prompt=job.prompt, **kwargs)
        pieces = []
        async for chunk in stream:
            now = time.perf_counter() - start
            text, finish = chunk_text(chunk, spec.endpoint)
            if text:  # a role-only or empty chunk is not a token
                record.chunk_s.append(now)
                pieces.append(text)
            record.finish_reason = finish or record.finish_reason
            if chunk.usage is not None:  # OpenAI sends it once, in a last chunk; some servers add it elsewhere
                record.prompt_tokens = chunk.usage.prompt_tokens
                record.output_tokens = chunk.usage.completion_tokens
                record.token_source = "usage"
        record.e2el_s = time.perf_counter() - start
        record.text = "".join(pieces)
        record.ttft_s = record.chunk_s[0] if record.chunk_s else None
        if record.token_source == "chunks":
            record.output_tokens = len(record.chunk_s)
        record.ok = True
    except Exception as e:  # noqa: BLE001  (whatever went wrong belongs to this request only)
        record.error = describe_error(e)


async def run_load(spec: LoadSpec, url: str, model: str, *, api_key: str = "EMPTY",
                   on_done: Callable[[RequestRecord], None] | None = None) -> LoadResult:
    """Send the workload of `spec` to `url` (a base URL ending in /v1); `on_done` hears of each finished request."""
    import openai

    spec.check()
    jobs = make_workload(spec)
    records = [RequestRecord(j.index, j.input_words, j.max_tokens, j.arrival_s) for j in jobs]
    slots = asyncio.Semaphore(spec.concurrency)
    client = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=spec.timeout)

    async def one(job: Job, record: RequestRecord) -> None:
        await asyncio.sleep(max(0.0, t0 + job.arrival_s - time.perf_counter()))
        async with slots:
            await send(client, spec, model, job, record, t0)
        if on_done is not None:
            on_done(record)

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(j, r) for j, r in zip(jobs, records)))
        duration = time.perf_counter() - t0
    finally:
        await client.close()
    return LoadResult(spec, url, model, records, duration)


async def discover_model(url: str, api_key: str = "EMPTY", timeout: float = 10.0) -> str:
    """The first model id the server lists, or LoadError asking for --model."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=timeout)
    try:
        page = await client.models.list()
        ids = [m.id for m in page.data]
    except Exception as e:  # noqa: BLE001
        raise LoadError(f"could not list the models at {url}/models ({describe_error(e)}); pass --model") from None
    finally:
        await client.close()
    if not ids:
        raise LoadError(f"{url}/models lists no model; pass --model")
    return ids[0]


# ----- the numbers -----

def stats_ms(values_s: list[float]) -> dict:
    """mean, p50, p90, p99 of seconds, in milliseconds (None each when there are no values)."""
    ms = [v * 1e3 for v in values_s]
    return {"mean": sum(ms) / len(ms) if ms else None, **harness.percentiles(ms, (50, 90, 99))}


def meets(record: RequestRecord, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    """A completed request within every bound given. A request of one token has no TPOT: only TTFT can fail it."""
    if not record.ok:
        return False
    if ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1e3 > ttft_ms):
        return False
    tpot = record.tpot_s
    return not (tpot_ms is not None and tpot is not None and tpot * 1e3 > tpot_ms)


def summarize(records: list[RequestRecord], duration_s: float, goodput_ttft_ms: float | None = None,
              goodput_tpot_ms: float | None = None) -> dict:
    """Every number of the report, from the records of one run."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    output = sum(r.output_tokens for r in done)
    counted = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    # Total throughput needs the prompt tokens: the server's count when it gave one, else the words sent.
    prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_words for r in done)
    sources = sorted({r.token_source for r in done})
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)  # noqa: E731
    summary = {
        "completed": len(done), "failed": len(failed), "first_error": failed[0].error if failed else None,
        "duration_s": duration_s, "output_tokens": output, "prompt_tokens": prompt,
        "prompt_tokens_source": "usage" if len(counted) == len(done) else "usage+words" if counted else "words",
        "output_tokens_source": "+".join(sources) if sources else None,
        "request_throughput": per_s(len(done)), "output_throughput": per_s(output),
        "total_token_throughput": per_s(output + prompt),
        "ttft_ms": stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": stats_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl_s]),
        "e2el_ms": stats_ms([r.e2el_s for r in done if r.e2el_s is not None]),
        "short_outputs": sum(r.output_tokens < r.max_tokens for r in done),
    }
    if goodput_ttft_ms is not None or goodput_tpot_ms is not None:
        good = sum(meets(r, goodput_ttft_ms, goodput_tpot_ms) for r in records)
        summary.update(good_requests=good, goodput=per_s(good),
                       goodput_bounds={"ttft_ms": goodput_ttft_ms, "tpot_ms": goodput_tpot_ms})
    return summary


def result_json(result: LoadResult, summary: dict) -> dict:
    """The report plus every request, as plain JSON."""
    spec = asdict(result.spec)
    spec["request_rate"] = None if math.isinf(result.spec.request_rate) else result.spec.request_rate
    requests = [{**asdict(r), "itl_s": r.itl_s, "tpot_s": r.tpot_s} for r in result.records]
    return {"url": result.url, "model": result.model, "spec": spec, "summary": summary, "requests": requests}


# ----- the command line -----

def show(console, result: LoadResult, summary: dict) -> None:
    s, spec = summary, result.spec
    console.print(f"[bold]{spec.num_requests} requests[/] to {result.url}, {spec.endpoint} endpoint, model "
                  f"{result.model}, concurrency {spec.concurrency}, request rate {spec.request_rate:g}/s "
                  f"({spec.arrivals}), seed {spec.seed}")
    rows = [("completed / failed", f"{s['completed']} / {s['failed']}"), ("duration", f"{s['duration_s']:.2f} s"),
            ("request throughput", harness.fmt(s["request_throughput"], " req/s", 2)),
            ("output token throughput", harness.fmt(s["output_throughput"], " tok/s")),
            ("total token throughput", harness.fmt(s["total_token_throughput"], " tok/s")),
            ("output tokens (counted from)", f"{s['output_tokens']:,} ({s['output_tokens_source']})"),
            ("prompt tokens (counted from)", f"{s['prompt_tokens']:,} ({s['prompt_tokens_source']})")]
    if s["short_outputs"]:
        rows.append(("requests shorter than max_tokens", str(s["short_outputs"])))
    if "goodput" in s:
        bounds = ", ".join(f"{k.removesuffix('_ms').upper()} ≤ {v:g} ms" for k, v in s["goodput_bounds"].items()
                           if v is not None)
        rows.append((f"goodput ({bounds})", f"{harness.fmt(s['goodput'], ' req/s', 2)} ({s['good_requests']} requests)"))
    console.print(harness.table("", ["metric", "value"], rows))
    console.print(harness.table("latency (ms)", ["metric", "mean", "p50", "p90", "p99"], [
        [name, *(harness.fmt(s[key][q]) for q in ("mean", "p50", "p90", "p99"))]
        for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))]))
    if s["failed"]:
        console.print(f"[red]{s['failed']} request(s) failed[/]; the first: {s['first_error']}")


def parser() -> OneLineParser:
    p = OneLineParser(prog="load.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="base URL, /v1 included")
    p.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--endpoint", default="chat", choices=ENDPOINTS)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8, help="most requests in flight at once (default: 8)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests released per second (default: inf, every request at once)")
    p.add_argument("--arrivals", default="poisson", choices=ARRIVALS, help="gaps between releases (default: poisson)")
    p.add_argument("--input-len", default="32-256", help="prompt words, MIN-MAX (default: 32-256)")
    p.add_argument("--output-len", default="16-64", help="max_tokens, MIN-MAX (default: 16-64)")
    p.add_argument("--seed", type=int, default=0, help="the same seed sends the same workload (default: 0)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens tokens")
    p.add_argument("--ignore-eos-field", default="ignore_eos", choices=EOS_FIELDS,
                   help="how --ignore-eos is sent: ignore_eos (vLLM, SGLang, this course), generation_config "
                        "(transformers serve) or min_tokens (llama-cpp-python's server)")
    p.add_argument("--goodput-ttft-ms", type=float, help="goodput bound on TTFT")
    p.add_argument("--goodput-tpot-ms", type=float, help="goodput bound on TPOT")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    p.add_argument("--json", metavar="PATH", help="also write the metrics and every request as JSON")
    return p


def spec_from_args(args) -> LoadSpec:
    spec = LoadSpec(num_requests=args.num_requests, concurrency=args.concurrency, request_rate=args.request_rate,
                    arrivals=args.arrivals, input_len=parse_range(args.input_len, "input-len"),
                    output_len=parse_range(args.output_len, "output-len"), seed=args.seed, endpoint=args.endpoint,
                    ignore_eos=args.ignore_eos, ignore_eos_field=args.ignore_eos_field, timeout=args.timeout)
    spec.check()
    for name in ("goodput_ttft_ms", "goodput_tpot_ms"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise LoadError(f"--{name.replace('_', '-')} must be positive, got {value}")
    return spec


async def cli(args, spec: LoadSpec, console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    url = args.url.rstrip("/")
    model = args.model or await discover_model(url, args.api_key)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True,
                  disable=not console.is_terminal) as progress:  # a log file gets the table, not the bar
        task = progress.add_task(f"{spec.endpoint} → {model}", total=spec.num_requests)
        result = await run_load(spec, url, model, api_key=args.api_key, on_done=lambda r: progress.advance(task))
    summary = summarize(result.records, result.duration_s, args.goodput_ttft_ms, args.goodput_tpot_ms)
    show(console, result, summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result_json(result, summary), indent=1))
        console.print(f"results written to {args.json}")
    return 1 if summary["failed"] else 0


def main() -> None:
    from rich.console import Console

    args = parser().parse_args()
    console = Console(width=None if sys.stdout.isatty() else 120)
    try:
        spec = spec_from_args(args)
        status = asyncio.run(cli(args, spec, console))
    except LoadError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(status)


if __name__ == "__main__":
    main()

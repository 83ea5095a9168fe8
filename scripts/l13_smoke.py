"""L13 smoke: structured output. Three requests at once, each held to a grammar that llguidance compiles against
the tokenizer (a JSON schema with a nested object, an array and enums; a regex; a choice list). Greedy: every
output's tokens must equal HF generate's run with the same grammar as a logits processor, and every output must
parse and validate. Seeded sampling: every output validates, and the same seeds give the same tokens twice. Then
the same requests through scripts/serve.py with the official openai client: the greedy texts must be the engine's.

    python scripts/l13_smoke.py                                  # the embedded model, fp32 on the CPU
    python scripts/l13_smoke.py --prompt "Tell me about Rome:"   # one prompt: all three grammars on it
    python scripts/l13_smoke.py --dtype bfloat16                 # half precision: ties as the parity rule judges them
"""
from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402

from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.engine import Arrival  # noqa: E402
from lessons.l13_structured import L13Engine  # noqa: E402
from lessons.l13_structured.grammar import Grammar, GrammarCompiler, GrammarSpec  # noqa: E402
from lessons.l13_structured.sampling import ConstrainedSampling  # noqa: E402
from shared.cli import smoke_parser  # noqa: E402
from shared.errors import RunFailure  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.hf_reference import HfReference  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.parity import Verdict, compare  # noqa: E402
from shared.pool_trace import record_engine  # noqa: E402
from shared.server_process import ServerProcess  # noqa: E402
from shared.smoke import Setup, _describe, exit_with, prepare  # noqa: E402

if TYPE_CHECKING:
    import openai

# The bounded grammars' greedy outputs on the embedded model take 3 (choice), 7 (regex) and about 45 (JSON)
# tokens; 64 leaves room for the JSON's strings to come out in smaller pieces under other prompts or dtypes.
# An output cut off before its grammar completes is a valid prefix, reported as finish_reason "length".
DEFAULT_MAX_NEW_TOKENS = 64
# Every string has a maxLength, every number a range, the array a maxItems and no object takes other keys: a
# random-weight model finishes it within the budget (an unbounded string could run to max-new-tokens).
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genre": {"enum": ["fiction", "poetry", "history"]},
        "author": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10},
                           "born": {"type": "integer", "minimum": 1800, "maximum": 2020}},
            "required": ["name", "born"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["new", "classic", "short"]}, "maxItems": 2},
    },
    "required": ["title", "year", "genre", "author", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-[0-9]{3,4}"
CHOICES = ["yes", "no", "maybe"]
GRAMMARS = (GrammarSpec("json_schema", SCHEMA, "response_format.json_schema.schema"),
            GrammarSpec("regex", REGEX, "structured_outputs.regex"),
            GrammarSpec("choice", CHOICES, "structured_outputs.choice"))
DEFAULT_PROMPTS = ["Describe a book as JSON:", "A product code:", "Is the sky blue? Answer:"]
TEMPERATURE = 0.8
# request i samples with seed FIRST_SEED + i: on the embedded model, seeds 5 and 6 move the JSON and the regex off
# their greedy outputs (the model is peaked: many seeds sample the greedy tokens)
FIRST_SEED = 5
SCHEMA_NAME = "book"


@dataclass(frozen=True)
class Request:
    prompt: str
    prompt_ids: list[int]
    spec: GrammarSpec
    seed: int  # for the sampled run


@dataclass
class Output:
    """One output and what it is: its text (special tokens skipped), how it ended, whether it is valid."""

    tokens: list[int]
    text: str
    finish: str  # "stop": the grammar completed and EOS ended it; "length": max-new-tokens cut it off
    problem: str | None  # None: valid (a complete output validates; a cut-off one is a valid prefix)


@dataclass
class Served:
    greedy: list[dict] = field(default_factory=list)
    sampled: list[dict] = field(default_factory=list)
    chat: dict | None = None
    structured: dict[str, int] = field(default_factory=dict)  # /metrics: constrained requests by kind
    exit_status: int | None = None
    seconds: float = 0.0


def parser():
    p = smoke_parser("L13", __doc__.split("\n\n")[0], blocks=True, default_prompts=DEFAULT_PROMPTS)
    options = p._option_string_actions  # two of the common options say more here
    options["--prompt"].help = (f"repeatable; request i gets prompt i (cycling) and grammar i %% 3 (JSON schema, "
                                f"regex, choice), over max(3, prompts) requests: one prompt gets all three "
                                f"grammars, four prompts give four requests (default: {DEFAULT_PROMPTS!r})")
    options["--max-new-tokens"].default = DEFAULT_MAX_NEW_TOKENS
    options["--max-new-tokens"].help = (f"most tokens per output (default: {DEFAULT_MAX_NEW_TOKENS}: the default "
                                        f"prompts' JSON takes about 45; an output cut off before its grammar "
                                        f"completes is checked as a valid prefix)")
    options["--ignore-eos"].help = ("accepted for the common contract: a grammar's end is EOS, and it ends a "
                                    "constrained output regardless")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="off: every step eager")
    return p


def requests_for(setup: Setup) -> list[Request]:
    """max(3, prompts) requests: prompt i (cycling) with grammar i % 3, so every grammar and every prompt runs."""
    n = max(len(GRAMMARS), len(setup.prompts))
    return [Request(setup.prompts[i % len(setup.prompts)], setup.prompt_ids[i % len(setup.prompts)],
                    GRAMMARS[i % len(GRAMMARS)], FIRST_SEED + i) for i in range(n)]


def validate(spec: GrammarSpec, text: str) -> str | None:
    """What is wrong with a complete output's text, by the grammar's own standard; None when it is valid."""
    if spec.kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), spec.source)
        except json.JSONDecodeError as e:
            return f"does not parse as JSON: {e}"
        except jsonschema.ValidationError as e:
            return f"does not validate against the schema: {e.message}"
    elif spec.kind == "regex" and re.fullmatch(spec.source, text) is None:
        return f"does not match {spec.source!r} (re.fullmatch)"
    elif spec.kind == "choice" and text not in spec.source:
        return f"is not one of {spec.source}"
    return None


def judge_output(tokens: list[int], grammar: Grammar, setup: Setup) -> Output:
    text = setup.tokenizer.decode(tokens, skip_special_tokens=True)
    if tokens and tokens[-1] in grammar.eos_ids:
        return Output(tokens, text, "stop", validate(grammar.spec, text))
    valid = grammar.matcher().validate_tokens(tokens)  # how many leading tokens the grammar allows
    return Output(tokens, text, "length",
                  None if valid == len(tokens) else f"token {valid} ({tokens[valid]}) is not allowed by the grammar")


# The server: scripts/serve.py as a child process, started while the engine and HF run.

def server_args(args) -> list[str]:
    out = ["--block-size", str(args.block_size), "--backend", args.backend, "--graphs", args.graphs,
           "--device", args.device]
    for flag, value in (("--model", args.model), ("--dtype", args.dtype), ("--num-blocks", args.num_blocks)):
        if value is not None:
            out += [flag, str(value)]
    return out


class BackgroundServer:
    """ServerProcess.start() waits for the banner; here it waits in a thread while the smoke does its own work."""

    def __init__(self, args):
        self.server = ServerProcess(server_args(args))
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._start, daemon=True)
        self.thread.start()

    def _start(self) -> None:
        try:
            self.server.start()
        except RuntimeError as e:
            self.error = e

    def close(self) -> None:
        """Stopped however the smoke ends; one still starting is killed, which ends its wait."""
        if self.thread.is_alive() and self.server.proc is not None:
            self.server.kill()
        self.thread.join()
        self.server.stop()

    def ready(self) -> ServerProcess:
        self.thread.join()
        if self.error is not None:
            raise RunFailure(f"the server did not start: {self.error}")
        return self.server


def constraint(spec: GrammarSpec) -> dict:
    """The request fields that ask for a grammar: OpenAI's response_format for a schema, vLLM's
    structured_outputs for a regex or a choice list."""
    if spec.kind == "json_schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": SCHEMA_NAME, "schema": spec.source, "strict": True}}}
    return {"structured_outputs": {spec.kind: spec.source}}


async def complete(client: openai.AsyncOpenAI, model: str, request: Request, args, sampled: bool) -> dict:
    kwargs = dict(model=model, prompt=request.prompt_ids, max_tokens=args.max_new_tokens,
                  temperature=TEMPERATURE if sampled else 0,
                  extra_body={"return_token_ids": True, "ignore_eos": args.ignore_eos, **constraint(request.spec)})
    if sampled:
        kwargs["seed"] = request.seed
    choice = (await client.completions.create(**kwargs)).choices[0]
    return {"tokens": choice.model_extra["token_ids"], "text": choice.text, "finish": choice.finish_reason}


async def chat(client: openai.AsyncOpenAI, model: str, prompt: str, args) -> dict:
    """The JSON schema on chat completions through the client's own response_format parameter."""
    fmt = constraint(GRAMMARS[0])["response_format"]
    r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=args.max_new_tokens, temperature=0, response_format=fmt)
    return {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason}


async def send_all(url: str, model: str, requests: list[Request], args) -> tuple[list[dict], list[dict], dict]:
    import openai  # the official client, imported here: --help stays quick

    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as client:
        replies = await asyncio.gather(*(complete(client, model, r, args, sampled) for sampled in (False, True)
                                         for r in requests), chat(client, model, requests[0].prompt, args))
    n = len(requests)
    return list(replies[:n]), list(replies[n:2 * n]), replies[-1]


def structured_counts(url: str) -> dict[str, int]:
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    return {kind: int(float(value)) for kind, value in
            re.findall(r'^paged_structured_requests_total\{kind="(\w+)"\} (\S+)$', text, re.M)}


def serve(background: BackgroundServer, requests: list[Request], args) -> Served:
    """Every request greedy and sampled, and the JSON one on chat, at once; then /metrics and SIGTERM."""
    import openai

    server = background.ready()
    served = Served()
    t0 = time.perf_counter()
    try:
        served.greedy, served.sampled, served.chat = asyncio.run(send_all(server.url, server.model, requests, args))
        served.structured = structured_counts(server.url)
    except (openai.OpenAIError, httpx.HTTPError) as e:
        raise RunFailure(f"the server failed a request: {type(e).__name__}: {e}; its log ends: "
                         f"{server.stderr_tail()}") from None
    finally:
        served.exit_status = server.stop()
    served.seconds = time.perf_counter() - t0
    return served


# The run.

def make_engine(args, model: Qwen3ForCausalLM) -> L13Engine:
    """The engine the server runs too: serve.py builds L13Engine with the same block size, pool and backend."""
    return L13Engine(model, args.block_size, args.num_blocks, backend=args.backend, graphs=args.graphs == "on")


def run_engine(engine: L13Engine, args, requests: list[Request], grammars: dict[str, Grammar], stop: StopRule,
               sampled: bool) -> list[list[int]]:
    """All the requests at once on `engine`, fresh for each run (a sampled repeat must not find the first run's
    cached prefixes: in half precision a different computation of the same prompt may move a sample)."""
    arrivals = [Arrival(r.prompt_ids, stop, ConstrainedSampling(
        temperature=TEMPERATURE if sampled else 0.0, seed=r.seed if sampled else None, grammar=grammars[r.spec.key]))
        for r in requests]
    outputs = engine.run(arrivals)
    leaked = engine.usable_blocks - engine.allocator.num_free
    if leaked:
        raise RunFailure(f"the engine kept {leaked} blocks after every request finished")
    args.engine_line = f"{type(engine.runner).__name__} with backend {engine.runner.backend.name}"
    return outputs


def run(args) -> int:
    console = Console(stderr=args.json)
    setup = prepare(args, Console(stderr=True))
    requests = requests_for(setup)
    seconds: dict[str, float] = {}
    quiet = args.json
    with console.status("loading weights...") if not quiet else nullcontext():
        t0 = time.perf_counter()
        model = Qwen3ForCausalLM.from_dir(setup.model_dir, setup.dtype, setup.device)
        engine = make_engine(args, model)  # bad engine options and requests fail here, before a server starts
        for r in requests:
            engine.check_request(r.prompt_ids, setup.stop, ConstrainedSampling())
        seconds["load"] = time.perf_counter() - t0
    background = BackgroundServer(args)
    try:
        return checks(args, console, setup, model, engine, requests, background, seconds)
    finally:
        background.close()


def checks(args, console: Console, setup: Setup, model: Qwen3ForCausalLM, engine: L13Engine, requests: list[Request],
           background: BackgroundServer, seconds: dict[str, float]) -> int:
    quiet = args.json
    stop, eos = setup.stop, frozenset(setup.config.eos_token_ids)
    with console.status("compiling the grammars...") if not quiet else nullcontext():
        t0 = time.perf_counter()
        compiler = GrammarCompiler(setup.tokenizer, setup.config.vocab_size, eos)
        seconds["tokenizer for llguidance"] = time.perf_counter() - t0
        grammars = {spec.key: compiler.compile(spec) for spec in GRAMMARS}
    t0 = time.perf_counter()
    with record_engine(engine, args.trace, "l13"):  # --trace: the lesson's run, grammars and all
        greedy = run_engine(engine, args, requests, grammars, stop, sampled=False)
    seconds["L13 greedy"] = time.perf_counter() - t0

    # HF with the same grammar: EOS is the grammar's end, and ends HF's output too (even with --ignore-eos)
    hf_stop = StopRule(stop.max_new_tokens, eos, ignore_eos=False)
    with console.status("HF generate with the grammar's logits processor...") if not quiet else nullcontext():
        t0 = time.perf_counter()
        from lessons.l13_structured.hf_processor import GrammarOracle  # imports transformers: not for --help

        hf = HfReference(setup.model_dir, setup.dtype, setup.device)
        oracles = [GrammarOracle(hf, grammars[r.spec.key], len(r.prompt_ids)) for r in requests]
        hf_out = [o.generate(r.prompt_ids, hf_stop) for o, r in zip(oracles, requests)]
        seconds["HF"] = time.perf_counter() - t0
    verdicts = [compare(out, h, setup.dtype, hf_stop, r.prompt_ids, o)
                for out, h, r, o in zip(greedy, hf_out, requests, oracles)]
    greedy_out = [judge_output(t, grammars[r.spec.key], setup) for t, r in zip(greedy, requests)]

    t0 = time.perf_counter()
    sampled = run_engine(make_engine(args, model), args, requests, grammars, stop, sampled=True)
    again = run_engine(make_engine(args, model), args, requests, grammars, stop, sampled=True)
    seconds["L13 sampled, twice"] = time.perf_counter() - t0
    sampled_out = [judge_output(t, grammars[r.spec.key], setup) for t, r in zip(sampled, requests)]

    with console.status("the same requests through scripts/serve.py...") if not quiet else nullcontext():
        served = serve(background, requests, args)
    seconds["server requests"] = served.seconds
    server_verdicts = [compare(s["tokens"], h, setup.dtype, hf_stop, r.prompt_ids, o)
                       for s, h, r, o in zip(served.greedy, hf_out, requests, oracles)]

    parts = judge_parts(args, setup, requests, grammars, greedy_out, verdicts, sampled_out, again, served,
                        server_verdicts)
    ok = all(passed for passed, _ in parts.values())
    if args.json:
        print(json.dumps(as_json(args, setup, requests, hf_out, greedy_out, verdicts, sampled_out, again, served,
                                 server_verdicts, parts, seconds, ok)))
    else:
        report(console, args, setup, requests, grammars, hf_out, greedy_out, verdicts, sampled_out, again, served,
               server_verdicts, parts, seconds)
    return 0 if ok else 1


def judge_parts(args, setup: Setup, requests, grammars, greedy_out: list[Output], verdicts: list[Verdict],
                sampled_out: list[Output], again: list[list[int]], served: Served,
                server_verdicts: list[Verdict]) -> dict[str, tuple[bool, str]]:
    """Each part's verdict and its one line: parity, validity, sampling, the server."""
    n, fp32 = len(requests), setup.dtype == torch.float32
    # With the default prompts and budget every output must complete: a cut-off one is valid only as a prefix.
    demanded = args.prompt is None and args.max_new_tokens >= DEFAULT_MAX_NEW_TOKENS
    parts = {}
    diverged = [i for i, v in enumerate(verdicts) if not v.ok]
    ties = sum(v.status == "tie" for v in verdicts)
    parts["parity"] = (not diverged, (
        f"greedy: every output's tokens equal HF generate's with the grammar's logits processor ({n} requests"
        f"{f', {ties} with half-precision ties' if ties else ''})" if not diverged else
        f"greedy: request {', '.join(map(str, diverged))} diverged from HF generate with the grammar's processor"))

    def validity(outputs: list[Output]) -> list[str]:
        bad = [f"request {i} {o.problem}" for i, o in enumerate(outputs) if o.problem]
        if demanded:
            bad += [f"request {i} was cut off at max-new-tokens" for i, o in enumerate(outputs) if o.finish != "stop"]
        return bad

    def valid(outputs: list[Output]) -> str:
        cut = sum(o.finish == "length" for o in outputs)
        if not cut:
            return f"every output parses and validates ({n} of {n} complete)"
        return (f"every complete output parses and validates, every cut-off one is a valid prefix ({n - cut} of {n} "
                f"complete, {cut} cut off at max-new-tokens)")

    bad = validity(greedy_out)
    parts["valid"] = (not bad, (f"greedy: {valid(greedy_out)}; JSON: jsonschema.validate, regex: re.fullmatch, "
                                f"choice: membership") if not bad else "greedy: " + "; ".join(bad))
    bad = validity(sampled_out)
    differ = [i for i, (o, a) in enumerate(zip(sampled_out, again)) if o.tokens != a]
    bad += [f"request {i} gave other tokens the second time with the same seed" for i in differ]
    seeds = ", ".join(str(r.seed) for r in requests)
    parts["sampled"] = (not bad, (f"sampled (temperature {TEMPERATURE}, seeds {seeds}): {valid(sampled_out)}, and a "
                                  f"fresh engine given the same seeds gave the same tokens") if not bad
                        else "sampled: " + "; ".join(bad))

    bad = []
    for i, (s, mine, v) in enumerate(zip(served.greedy, greedy_out, server_verdicts)):
        # fp32: the server's engine is this one, so its text is; half precision: a different batch may tie
        if s["text"] != mine.text and (fp32 or not v.ok):
            bad.append(f"request {i}: the server's greedy text {s['text']!r} is not the engine's {mine.text!r}")
        if not v.ok:
            bad.append(f"request {i}: the server's greedy tokens diverged from HF's")
        if s["finish"] != mine.finish and s["tokens"] == mine.tokens:
            bad.append(f"request {i}: finish_reason {s['finish']!r}, the engine's output ended with {mine.finish!r}")
    for i, (s, r) in enumerate(zip(served.sampled, requests)):
        out = judge_output(s["tokens"], grammars[r.spec.key], setup)
        if out.problem or (demanded and out.finish != "stop"):
            bad.append(f"request {i} sampled: {out.problem or 'cut off'}")
        if s["text"] != out.text:
            bad.append(f"request {i} sampled: text {s['text']!r} is not its decoded tokens")
        if fp32 and s["tokens"] != sampled_out[i].tokens:  # half precision: a batch of other rows may move a sample
            bad.append(f"request {i} sampled: the server's tokens are not the engine's with the same seed")
    chat_problem = validate(GRAMMARS[0], served.chat["text"]) if served.chat["finish"] == "stop" else None
    if chat_problem or (demanded and served.chat["finish"] != "stop"):
        bad.append(f"chat with response_format: {chat_problem or 'cut off'}")
    expected = {}
    for r in requests:
        expected[r.spec.kind] = expected.get(r.spec.kind, 0) + 2  # greedy and sampled
    expected["json_schema"] = expected.get("json_schema", 0) + 1  # the chat request
    counted = {kind: served.structured.get(kind, 0) for kind in expected}
    if counted != expected:
        bad.append(f"/metrics counted {counted} constrained requests, {expected} were sent")
    if served.exit_status != 0:
        bad.append(f"exit status {served.exit_status} after SIGTERM")
    sampled_same = ("equal to the engine's with the same seeds" if fp32
                    else "valid (tokens not compared in half precision)")
    chat_line = "validates" if served.chat["finish"] == "stop" else "was cut off at max-new-tokens"
    parts["server"] = (not bad, (
        f"server: {n} greedy completions gave the engine's texts and tokens, {n} sampled ones {sampled_same}, a chat "
        f"completion with response_format json_schema {chat_line}, /metrics counted every constrained request, exit "
        f"status 0 after SIGTERM") if not bad else "server: " + "; ".join(bad))
    return parts


def as_json(args, setup: Setup, requests, hf_out, greedy_out, verdicts, sampled_out, again, served, server_verdicts,
            parts, seconds, ok) -> dict:
    """shared.smoke's shape (what scripts/checks/parity_matrix.py reads): per request the HF tokens and, per runner,
    its tokens and verdict; the other parts in extra_check."""
    entries = []
    for i, r in enumerate(requests):
        entries.append({
            "prompt": r.prompt, "prompt_ids": r.prompt_ids, "grammar": r.spec.kind, "hf": hf_out[i].tokens,
            "L13": greedy_out[i].tokens, "L13_verdict": verdicts[i].to_json(),
            "server": served.greedy[i]["tokens"], "server_verdict": server_verdicts[i].to_json(),
            "match": verdicts[i].ok and server_verdicts[i].ok,
            "text": greedy_out[i].text, "finish": greedy_out[i].finish, "valid": greedy_out[i].problem is None,
            "server_text": served.greedy[i]["text"],
            "sampled": {"seed": r.seed, "temperature": TEMPERATURE, "tokens": sampled_out[i].tokens,
                        "again": again[i], "text": sampled_out[i].text, "finish": sampled_out[i].finish,
                        "valid": sampled_out[i].problem is None, "server": served.sampled[i]["tokens"]},
        })
    failed = [line for name, (passed, line) in parts.items() if name != "parity" and not passed]
    return {
        "lesson": "L13", "model": str(setup.model_dir), "device": str(setup.device),
        "dtype": str(setup.dtype).removeprefix("torch."), "max_new_tokens": setup.stop.max_new_tokens,
        "ignore_eos": setup.stop.ignore_eos, "block_size": args.block_size, "prompts": entries,
        "chat": served.chat, "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "match": all(e["match"] for e in entries),
        "extra_check": {"ok": not failed, "message": "; ".join(failed) or "; ".join(
            line for name, (_, line) in parts.items() if name != "parity")},
        "ok": ok,
    }


def report(console: Console, args, setup: Setup, requests, grammars, hf_out, greedy_out, verdicts, sampled_out, again,
           served, server_verdicts, parts, seconds) -> None:
    def say(text: str) -> None:
        console.print(escape(text), soft_wrap=True, highlight=False)

    dtype = str(setup.dtype).removeprefix("torch.")
    console.print(f"[bold]L13 smoke[/] · model {setup.model_dir} · {setup.device} {dtype} · threads "
                  f"{torch.get_num_threads()} · max-new-tokens {setup.stop.max_new_tokens}"
                  f"{' · ignore-eos' if setup.stop.ignore_eos else ''} · block size {args.block_size} · "
                  f"{args.engine_line} · graphs {args.graphs}", soft_wrap=True, highlight=False)
    say("grammars (llguidance): " + ", ".join(f"{g.spec.kind} {1000 * g.compile_seconds:.1f} ms"
                                              for g in grammars.values())
        + f" to compile; the tokenizer read once in {seconds['tokenizer for llguidance']:.2f} s")
    for i, r in enumerate(requests):
        console.rule(escape(f"request {i}: {r.spec.kind} · prompt {r.prompt!r} ({len(r.prompt_ids)} tokens)"))
        g, s = greedy_out[i], sampled_out[i]
        say(f"greedy : {len(g.tokens)} tokens, {g.finish}: {g.text!r}")
        console.print(f"L13 vs HF: {_describe(verdicts[i], setup.dtype, len(g.tokens))}", soft_wrap=True)
        say(f"  {'valid' if g.problem is None else 'INVALID: ' + g.problem}"
            + (" (a prefix cut off by max-new-tokens)" if g.finish == "length" else ""))
        same = "same tokens" if s.tokens == again[i] else "OTHER TOKENS"
        say(f"sampled: seed {r.seed}, {len(s.tokens)} tokens, {s.finish}: {s.text!r}; again with the same seed: {same}"
            + ("" if s.problem is None else f"; INVALID: {s.problem}"))
        text = served.greedy[i]["text"]
        say(f"server : {served.greedy[i]['finish']}, " + ("the engine's text" if text == g.text else f"{text!r}"))
        console.print(f"server vs HF: {_describe(server_verdicts[i], setup.dtype, len(served.greedy[i]['tokens']))}",
                      soft_wrap=True)
    console.rule("chat completion, response_format json_schema")
    say(f"{served.chat['finish']}: {served.chat['text']!r}")
    console.rule("timing")
    for name, s in seconds.items():
        say(f"{name:>26}: {s:7.3f} s")
    for passed, line in parts.values():
        console.print(("[bold green]PASS[/]: " if passed else "[bold red]FAIL[/]: ") + escape(line), soft_wrap=True,
                      highlight=False)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    exit_with(lambda: run(args))


if __name__ == "__main__":
    main()

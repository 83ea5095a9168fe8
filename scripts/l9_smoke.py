"""L9 smoke: the server. Starts scripts/serve.py on a free loopback port and sends every prompt at once with
the official `openai` client, half of them streamed, half not (greedy, token ids as the prompt, the
server's token ids returned beside its text). Each completion's tokens must equal HF's for that prompt
alone, and L8's (the engine the server runs, driven directly). The server's own check: every text equals
the decoded tokens (a stream's chunks joined), every finish_reason and usage is right, the pool holds no
request's blocks afterwards (GET /metrics), and SIGTERM ends the server with exit status 0."""
from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING  # noqa: E402
from lessons.l8_chunked_prefill import L8Engine  # noqa: E402
from lessons.l8_chunked_prefill.scheduler import DEFAULT_MAX_BATCHED_TOKENS  # noqa: E402
from shared.server_process import ServerProcess  # noqa: E402
from l8_smoke import DEFAULT_PROMPTS  # noqa: E402  (scripts/ is on the path when a smoke runs)
from shared.cli import smoke_parser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.smoke import main  # noqa: E402


def parser():
    p = smoke_parser("L9", __doc__, blocks=True, default_prompts=DEFAULT_PROMPTS)
    p.add_argument("--max-batched-tokens", type=int, default=DEFAULT_MAX_BATCHED_TOKENS,
                   help=f"the engine's token budget per step (default: {DEFAULT_MAX_BATCHED_TOKENS})")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="most requests in one step")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="off: every step eager")
    return p


def server_args(args) -> list[str]:
    out = ["--block-size", str(args.block_size), "--max-batched-tokens", str(args.max_batched_tokens),
           "--backend", args.backend, "--max-running", str(args.max_running), "--graphs", args.graphs,
           "--device", args.device]
    for flag, value in (("--model", args.model), ("--dtype", args.dtype), ("--num-blocks", args.num_blocks),
                        ("--trace", args.trace)):  # the server's engine is L9's: it records its own trace
        if value is not None:
            out += [flag, str(value)]
    return out


async def ask(client: openai.AsyncOpenAI, model: str, ids: list[int], max_tokens: int, ignore_eos: bool,
              stream: bool) -> dict:
    """One completion; returns its tokens, text, finish reason and usage however it arrived."""
    kwargs = dict(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": ignore_eos})
    if not stream:
        r = await client.completions.create(**kwargs)
        c = r.model_extra.get("prompt_token_ids"), r.choices[0]
        return {"tokens": c[1].model_extra["token_ids"], "text": c[1].text, "finish": [c[1].finish_reason],
                "usage": r.usage.model_dump(include={"prompt_tokens", "completion_tokens"}), "stream": False}
    tokens, text, finishes, usage = [], "", [], None
    async for chunk in await client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(include={"prompt_tokens", "completion_tokens"})
        for c in chunk.choices:
            tokens += c.model_extra.get("token_ids") or []
            text += c.text
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
    return {"tokens": tokens, "text": text, "finish": finishes, "usage": usage, "stream": True}


async def send_all(url: str, model: str, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[dict]:
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as client:
        return await asyncio.gather(*(ask(client, model, ids, max_tokens, ignore_eos, stream=i % 2 == 0)
                                      for i, ids in enumerate(prompts)))


def held_blocks(url: str) -> int:
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    return int(float(re.search(r"^paged_blocks_held (\S+)$", text, re.M).group(1)))


def build_engines(model, args):
    def l8_engine() -> L8Engine:
        return L8Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend,
                        graphs=args.graphs == "on", max_batched_tokens=args.max_batched_tokens)

    l8_engine()  # bad options (a block size of 0, a budget below 1) fail here with one line, not in the server
    # Started here, before the harness's clock: L9's time in the report is the requests', not the start-up's.
    try:
        args.server = server = ServerProcess(server_args(args)).start()
    except RuntimeError as e:
        raise CourseError(f"the server did not start: {e}") from None

    def l9(prompts, stop):
        args.replies = asyncio.run(send_all(server.url, server.model, prompts, stop.max_new_tokens, stop.ignore_eos))
        args.held_after = held_blocks(server.url)
        return [r["tokens"] for r in args.replies]

    def l8(prompts, stop):
        return l8_engine().generate_batch(prompts, stop)

    return {"L9": l9, "L8": l8}


def server_report(model, setup, args):
    """The server's own contract, beyond the tokens: text, finish reasons, usage, the pool, the exit."""
    problems = []
    exit_status = args.server.stop()
    eos = frozenset(setup.config.eos_token_ids)
    for i, (ids, r) in enumerate(zip(setup.prompt_ids, args.replies)):
        if r["text"] != setup.tokenizer.decode(r["tokens"]):
            problems.append(f"prompt {i}: text differs from its decoded tokens")
        ended_on_eos = not setup.stop.ignore_eos and bool(r["tokens"]) and r["tokens"][-1] in eos
        if r["finish"] != ["stop" if ended_on_eos else "length"]:
            problems.append(f"prompt {i}: finish_reason {r['finish']}")
        if r["usage"] != {"prompt_tokens": len(ids), "completion_tokens": len(r["tokens"])}:
            problems.append(f"prompt {i}: usage {r['usage']}")
    if args.held_after != 1:  # the CUDA-graph dummy block is held for the engine's life
        problems.append(f"{args.held_after} blocks held after every request finished (expected 1, the dummy)")
    if exit_status != 0:
        problems.append(f"exit status {exit_status} after SIGTERM")
    streamed = sum(r["stream"] for r in args.replies)
    line = (f"server: {len(args.replies)} concurrent requests ({streamed} streamed); text, finish_reason and usage "
            f"checked; blocks held after: {args.held_after}; exit status after SIGTERM: {exit_status}")
    return not problems, line + "".join(f"\n  {p}" for p in problems)


if __name__ == "__main__":
    main("L9", parser(), build_engines, server_report)

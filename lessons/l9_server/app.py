"""The HTTP side: FastAPI routes that check a request, hand it to the engine thread, and relay its events.

A request's life: body read (size-limited) -> fields checked (protocol.py) -> chat template rendered and
prompt tokenized (in a worker thread: long prompts take milliseconds) -> context checked -> submitted to the
engine thread -> the first event says accepted or refused (only then is a status code chosen) -> Deltas
relayed as SSE chunks, or gathered into one response -> Finished. If the client goes away first (stream
cancelled, or a disconnect noticed while a whole response is gathered), the request is aborted at once.
"""
from __future__ import annotations

import asyncio
import json
import re
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from tokenizers import Tokenizer

from lessons.l4_continuous.engine import check_token_ids
from lessons.l6_prefix_sharing.engine import check_n
from lessons.l9_server.chat import ChatTemplate
from lessons.l9_server.engine_loop import (RETRY_AFTER_S, Accepted, Delta, EngineLoop, EventBuffer, Failed, Finished,
                                           Subscriber)
from lessons.l9_server.protocol import ApiError, GenerationRequest, check_strings, parse_chat, parse_completion
from lessons.l9_server.responses import ResponseShape, sse
from shared.errors import CourseError

# A stream's client that lets this many tokens of one choice pile up unread (its socket full: it reads
# slowly, or not at all) is cut; a client that reads keeps up with any engine, so only a stuck one gets here.
MAX_STREAM_LAG = 1024
MAX_BODY_BYTES = 1 << 20  # 1 MiB: about 200,000 tokens of text, far past any context served here
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a UTF-16 surrogate, lone or paired, is written in JSON


@dataclass
class ServedModel:
    name: str  # what clients put in "model"
    tokenizer: Tokenizer
    chat: ChatTemplate | None  # None: chat completions are refused
    context: int  # max_position_embeddings: prompt + max_tokens must fit
    vocab_size: int


def create_app(model: ServedModel, loop: EngineLoop, default_max_tokens: int = 256,
               max_body_bytes: int = MAX_BODY_BYTES, structured=None) -> FastAPI:
    """`structured` (L13's StructuredOutputs) takes response_format and structured_outputs; without it they are
    refused by name, as any field this server does not implement."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        await run_in_threadpool(loop.stop)  # open requests have finished, or been answered (serve.py's shutdown)

    app = FastAPI(title="paged-attention-course L9", lifespan=lifespan)
    longest_token = longest_token_bytes(model.tokenizer)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        if e.status in (429, 503):
            loop.metrics.rejected.labels(str(e.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        # json.dumps escapes every non-ASCII character: a reply naming a bad string can always be encoded
        return Response(json.dumps(e.body()), status_code=e.status, headers=headers, media_type="application/json")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown path, wrong method
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.get("/health")
    async def health() -> Response:
        if loop.failure or not loop.accepting:
            return JSONResponse({"status": loop.failure or "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": model.name, "object": "model", "created": 0, "owned_by": "paged-attention-course",
                 "max_model_len": model.context}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, max_body_bytes)
        body, spec = structured.take(body) if structured else (body, None)
        req = parse_completion(body, default_max_tokens, model.context)
        admissible(body, req)
        if spec is not None:  # L13: compiled in a worker thread, after the refusals that cost nothing
            req = await structured.constrain(req, spec)
        return await generate(request, req, req.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, max_body_bytes)
        body, spec = structured.take(body) if structured else (body, None)
        messages, kwargs, req = parse_chat(body, default_max_tokens)
        if model.chat is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
        admissible(body, req)
        if spec is not None:
            req = await structured.constrain(req, spec)
        prompt = await run_in_threadpool(model.chat.render, messages, kwargs)
        return await generate(request, req, prompt, chat=True)

    def admissible(body: dict, req: GenerationRequest) -> None:
        """The refusals that cost nothing, made before the chat template and the tokenizer do any work."""
        if body["model"] != model.name:
            raise ApiError(404, f"model {body['model']!r} does not exist; this server serves {model.name!r}",
                           "model", code="model_not_found")
        if loop.num_waiting >= loop.max_waiting:  # submit() checks again, under its lock
            raise ApiError(429, f"{loop.max_waiting} requests are already waiting; retry in {RETRY_AFTER_S} s",
                           kind="rate_limit_error")
        if req.max_tokens >= model.context:
            raise ApiError(400, f"max_tokens ({req.max_tokens}) leaves no room for a prompt in the model's context "
                                f"of {model.context}", "max_tokens")

    async def generate(request: Request, req: GenerationRequest, prompt: str | list[int], chat: bool) -> Response:
        if isinstance(prompt, str):
            check_prompt_size(prompt, req, model, longest_token, "messages" if chat else "prompt")
            # encode_batch lets go of the GIL while it works (encode holds it: 0.5 s for 480 KB of text),
            # so the event loop goes on serving other requests meanwhile
            ids = (await run_in_threadpool(model.tokenizer.encode_batch, [prompt]))[0].ids
        else:
            ids = prompt
        check_request(ids, req, model)
        subscriber = Subscriber(asyncio.get_running_loop())
        request_id = loop.submit(ids, req, subscriber)
        get = asyncio.create_task(subscriber.events.get())  # Accepted or Failed, within one engine step
        gone = asyncio.create_task(disconnected(request))  # a client that leaves first frees this handler
        try:
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this task is cancelled (a shutdown past its grace period)
            gone.cancel()
            if not get.done():  # the inbox takes the abort after the step under way
                get.cancel()
                loop.abort(request_id)
        if get not in done:
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"
        first = get.result()
        if isinstance(first, Failed):
            raise first.error
        shape = ResponseShape(chat, model.name, req.return_token_ids, len(ids))
        if req.stream:
            return AbortingStream(stream(shape, req, subscriber, request_id), subscriber.events,
                                  lambda: loop.abort(request_id))
        return await whole(request, shape, req, ids, subscriber, request_id)

    async def stream(shape: ResponseShape, req: GenerationRequest, subscriber: Subscriber,
                     request_id: int) -> AsyncIterator[str]:
        """SSE chunks; AbortingStream aborts the request if the client leaves first. A client that falls
        MAX_STREAM_LAG tokens behind is cut: one line in the log, a count in /metrics, its request aborted."""
        def cut() -> None:
            print(f"request {request_id}: its client fell {MAX_STREAM_LAG} tokens behind the stream; aborted "
                  f"(slow reader)", file=sys.stderr, flush=True)
            loop.metrics.slow_readers.inc()
            loop.abort(request_id)

        subscriber.events.max_lag, subscriber.events.on_lag = MAX_STREAM_LAG, cut
        done = False
        started: set[int] = set()
        generated = 0  # tokens of all choices so far: stream_options.continuous_usage_stats reports them
        if shape.chat:  # the role first, as OpenAI does, so a client can render the turn at once
            for i in range(req.n):
                yield sse(shape.chunk(i, None, [], None, req.include_usage, first=True,
                                      generated=0 if req.continuous_usage else None))
            started = set(range(req.n))
        while not done:
            # every event waiting goes out in one write: one step's n choices, a lagging reader's backlog,
            # the last tokens with the usage chunk and [DONE]; one send through the ASGI stack, one syscall
            events = [await subscriber.events.get()]
            while not subscriber.events.empty():
                events.append(subscriber.events.get_nowait())
            out: list[str] = []
            for event in events:
                if isinstance(event, Delta):
                    generated += len(event.token_ids)
                    if event.text or event.finish_reason or (req.return_token_ids and event.token_ids):
                        out.append(sse(shape.chunk(event.index, event.text, event.token_ids, event.finish_reason,
                                                   req.include_usage, first=event.index not in started,
                                                   generated=generated if req.continuous_usage else None)))
                        started.add(event.index)
                elif isinstance(event, Finished):
                    if req.include_usage:
                        out.append(sse(shape.usage_chunk(event.prompt_tokens, event.completion_tokens)))
                    done = True
                elif isinstance(event, Failed):  # the engine failed, or this client fell behind: say so in-band
                    out.append(sse(event.error.body()))
                    done = True
            if done:  # after an error event too, as vLLM does: clients wait for it to end the stream
                out.append(sse("[DONE]"))
            if out:  # a Delta may carry no text yet (half a character): nothing to send
                yield "".join(out)

    async def whole(request: Request, shape: ResponseShape, req: GenerationRequest, ids: list[int],
                    subscriber: Subscriber, request_id: int) -> Response:
        texts, tokens, finishes = [""] * req.n, [[] for _ in range(req.n)], [""] * req.n
        gone = asyncio.create_task(disconnected(request))
        get: asyncio.Task | None = None
        try:
            while True:
                get = asyncio.create_task(subscriber.events.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the client left while its request waited or ran: `finally` aborts it
                    return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"
                event = get.result()
                if isinstance(event, Delta):
                    texts[event.index] += event.text
                    tokens[event.index] += event.token_ids
                    finishes[event.index] = event.finish_reason or ""
                elif isinstance(event, Finished):  # L15's prefill server sends one with top-level fields to add
                    return JSONResponse(shape.whole(texts, tokens, finishes, ids, event.completion_tokens)
                                        | getattr(event, "fields", {}))
                elif isinstance(event, Failed):
                    raise event.error
        finally:  # also when this task is cancelled (a shutdown past its grace period)
            gone.cancel()
            if get is not None and not get.done():
                get.cancel()
                loop.abort(request_id)

    return app


class AbortingStream(StreamingResponse):
    """An SSE response that aborts its request however it ends before the reader took the final event.

    The generator's own `finally` is not enough: Starlette cancels the response when the client leaves,
    and a generator cancelled before its first step never runs its body, so never its `finally` either."""

    def __init__(self, content: AsyncIterator[str], events: EventBuffer, abort: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events, self.abort = events, abort

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # a disconnect, a send that failed, or the task cancelled (a shutdown past its grace period)
            if not self.events.finished:
                self.abort()


def check_request(ids: list[int], req: GenerationRequest, model: ServedModel) -> None:
    """What the engine would refuse with a CLI-worded message, refused here with the field it concerns."""
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens", "prompt")
    if len(ids) + req.max_tokens > model.context:
        raise ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) = {len(ids) + req.max_tokens} "
                            f"exceeds the model's context of {model.context}", "max_tokens")
    try:
        check_token_ids(ids, req.sampling.stop_token_ids, model.vocab_size)
    except CourseError as e:
        raise ApiError(400, str(e), "stop_token_ids" if str(e).startswith("stop") else "prompt") from None
    try:
        check_n(req.n, req.sampling)
    except CourseError as e:
        raise ApiError(400, str(e), "n") from None


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most bytes of text one token stands for: a byte-level BPE piece has one character per byte (Qwen3's
    longest is 128 spaces); an added token (<|im_start|>) stands for its own text."""
    pieces = max(map(len, tokenizer.get_vocab(with_added_tokens=False)))
    added = (len(t.content.encode()) for t in tokenizer.get_added_tokens_decoder().values())
    return max([pieces, *added])


def check_prompt_size(prompt: str, req: GenerationRequest, model: ServedModel, longest_token: int,
                      param: str) -> None:
    """Refuse, before tokenizing, a prompt that cannot fit: every token stands for at most `longest_token`
    bytes of the normalized text, so a text of B bytes is at least B / longest_token tokens. The bound never
    refuses a prompt that fits, and it spares the tokenizer a megabyte that would be refused after."""
    room = model.context - req.max_tokens
    size = len(prompt.encode())
    if size > room * longest_token and model.tokenizer.normalizer is not None:
        size = len(model.tokenizer.normalizer.normalize_str(prompt).encode())  # NFC may compose into fewer bytes
    if size > room * longest_token:
        raise ApiError(400, f"the prompt is {size} bytes of text: at least {-(-size // longest_token)} tokens, "
                            f"past the {room} that max_tokens ({req.max_tokens}) leaves of the model's context "
                            f"({model.context})", param)


async def read_json(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit of {limit}")
    body = bytearray()
    try:
        async for piece in request.stream():  # a chunked body has no length header: count as it arrives
            body += piece
            if len(body) > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
    except ClientDisconnect:  # the client left half-way through its body: nobody reads the reply
        raise ApiError(499, "the client disconnected before sending its whole body") from None
    try:
        obj = json.loads(body)
    except ValueError as e:  # invalid UTF-8 too (UnicodeDecodeError)
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # json.loads recurses once per level: 10 KB of brackets exhaust Python's stack
        raise ApiError(400, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the body must be a JSON object")
    if SURROGATE_ESCAPE.search(body):  # only then can a string hold a lone surrogate: walk the body for one
        check_strings(obj)
    return obj


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects. The body has been read, so the next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

"""The proxy in front of a prefill server P and a decode server D (vLLM's toy_proxy_server, with its flow):

  client -> proxy  POST /v1/completions or /v1/chat/completions: any OpenAI request
  proxy  -> P      the same request with max_tokens 1 (max_completion_tokens, if it gave that), stream false, n 1
                   and kv_transfer_params {"do_remote_decode": true}: P prefills, samples one token (thrown away:
                   D samples its own from the same logits) and leases the prompt's pages
  P      -> proxy  its whole response, whose top-level kv_transfer_params say where D pulls the pages
  proxy  -> D      the client's request as sent, plus P's kv_transfer_params
  D      -> client D's answer as it is: streamed chunk by chunk, or whole. Its id and its usage are D's (the whole
                   prompt counted), as with vLLM's proxy; P's one token is never shown

Errors from P or D reach the client with their status and body (a body that is not OpenAI's error object becomes
a 502 naming the server); a server that cannot be reached is a 502, one that does not answer in time a 504; the
proxy itself never answers 500. A client that leaves closes the connection under way, to P or to D, so that server
aborts the request (a lease P already granted expires unused). GET /v1/models is D's; GET /health is ok only when
both servers' are.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from typing import AsyncIterator, TypeVar

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from lessons.l9_server.app import MAX_BODY_BYTES, disconnected, read_json
from lessons.l9_server.protocol import ApiError
from lessons.l9_server.responses import sse

DEFAULT_TIMEOUT_S = 300.0  # the longest wait for P's or D's next bytes: a whole (not streamed) answer comes at the end
CONNECT_TIMEOUT_S = 5.0
ERROR_TEXT = 200  # characters of a server's non-OpenAI error body quoted in the proxy's own
PASSED_HEADERS = ("retry-after",)  # a 429's or 503's advice holds for the client too
T = TypeVar("T")


def create_proxy(prefill: str, decode: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_body_bytes: int = MAX_BODY_BYTES, mounts: dict | None = None) -> FastAPI:
    """The proxy's app. `prefill`, `decode`: the servers' base URLs (http://127.0.0.1:8100, with or without /v1).
    `mounts`: httpx transports by URL prefix, for tests that serve P and D in process."""
    servers = {"prefill": base_url(prefill), "decode": base_url(decode)}
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S), mounts=mounts,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="paged-attention-course L15 proxy", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        return Response(json.dumps(e.body()), status_code=e.status, media_type="application/json")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:  # unknown path, wrong method
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    async def call(which: str, request: httpx.Request, stream: bool = False) -> httpx.Response:
        """P's or D's response; a server unreachable, failing mid-answer or too slow is the proxy's 502 or 504."""
        try:
            return await client.send(request, stream=stream)
        except httpx.TimeoutException:
            raise ApiError(504, f"the {which} server ({servers[which]}) did not answer within {timeout_s:g} s",
                           kind="server_error") from None
        except httpx.HTTPError as e:  # refused, reset, closed mid-answer
            raise ApiError(502, f"the {which} server ({servers[which]}) cannot be reached: "
                                f"{type(e).__name__}: {e}", kind="server_error") from None

    def post(which: str, path: str, body: dict) -> httpx.Request:
        return client.build_request("POST", servers[which] + path, json=body)

    # Task L15.8: the servers: P leases as a request ends, D pulls off the engine thread, the proxy sends P then D
    async def disaggregate(request: Request, path: str) -> Response:
        """One request through P (one token, the lease) then D (the answer, passed on as it comes)."""
        body = await read_json(request, max_body_bytes)  # L9's: 413 past the limit, 400 if not a JSON object
        if "kv_transfer_params" in body:
            raise ApiError(400, "kv_transfer_params is the proxy's to set: send the request without it",
                           "kv_transfer_params")
        first = {**body, "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True}}
        first.pop("stream_options", None)  # only with stream true
        first["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = 1
        answer = await until_gone(request, call("prefill", post("prefill", path, first)))
        if answer is None:
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"
        if answer.status_code != 200:
            return passed_on(answer, "prefill")
        try:
            params = answer.json()["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            params = None
        if not isinstance(params, dict):
            raise ApiError(502, f"the prefill server ({servers['prefill']}) answered without kv_transfer_params: is "
                                f"it started with --kv-role kv_producer?", kind="server_error")
        second = post("decode", path, {**body, "kv_transfer_params": params})
        if body.get("stream") is not True:
            answer = await until_gone(request, call("decode", second))
            return Response(status_code=499) if answer is None else passed_on(answer, "decode")
        upstream = await until_gone(request, call("decode", second, stream=True))
        if upstream is None:
            return Response(status_code=499)
        if upstream.status_code != 200:
            try:
                await upstream.aread()
            except httpx.HTTPError:
                pass
            finally:
                await upstream.aclose()
            return passed_on(upstream, "decode")
        return Relay(upstream)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await disaggregate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await disaggregate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        return passed_on(await call("decode", client.build_request("GET", servers["decode"] + "/v1/models")), "decode")

    @app.get("/health")
    async def health() -> Response:
        """ok only when both servers are: without P every request fails, without D too."""
        for which in ("prefill", "decode"):
            try:
                answer = await call(which, client.build_request("GET", servers[which] + "/health"))
            except ApiError as e:
                return JSONResponse({"status": e.message}, status_code=503)
            if answer.status_code != 200:
                status = f"the {which} server's health: {answer.status_code} {answer.text[:ERROR_TEXT]}"
                return JSONResponse({"status": status}, status_code=503)
        return JSONResponse({"status": "ok"})

    return app


def base_url(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


async def until_gone(request: Request, work: Awaitable[T]) -> T | None:
    """work's result, or None if the client left first: the work is cancelled then, which closes its connection to
    P or D, so that server aborts the request as it would for any client that leaves."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled (a shutdown)
        gone.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task in done else None


def passed_on(answer: httpx.Response, which: str) -> Response:
    """P's or D's answer as the client's: its status and body, byte for byte, when the body is JSON (an error, OpenAI's
    object); anything else becomes a 502 that names the server and quotes it."""
    headers = {k: v for k, v in answer.headers.items() if k.lower() in PASSED_HEADERS}
    try:
        body = answer.json()
    except ValueError:
        body = None
    if answer.status_code != 200 and not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        raise ApiError(502, f"the {which} server answered {answer.status_code}: {answer.text[:ERROR_TEXT]!r}",
                       kind="server_error")
    if body is None:
        raise ApiError(502, f"the {which} server's answer is not JSON: {answer.text[:ERROR_TEXT]!r}",
                       kind="server_error")
    return Response(answer.content, status_code=answer.status_code, headers=headers, media_type="application/json")


class Relay(StreamingResponse):
    """D's stream, chunk by chunk as it comes; D's connection is closed however the relay ends (the client left, or
    the handler was cancelled before the stream's generator ever ran, as L9's AbortingStream guards against), so
    D aborts the request. D failing mid-stream is said in-band, as D says its own failures."""

    def __init__(self, upstream: httpx.Response):
        super().__init__(self._chunks(upstream), media_type=upstream.headers.get("content-type", "text/event-stream"),
                         headers={"Cache-Control": "no-cache"})
        self.upstream = upstream

    @staticmethod
    async def _chunks(upstream: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError as e:
            error = ApiError(502, f"the decode server's stream broke: {type(e).__name__}: {e}", kind="server_error")
            yield (sse(error.body()) + sse("[DONE]")).encode()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # closes even when this task is being cancelled
                await self.upstream.aclose()

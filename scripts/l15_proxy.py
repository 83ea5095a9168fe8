"""L15: the proxy in front of a prefill server and a decode server (vLLM's toy_proxy_server): each request goes to
the prefill server for one token, which leases the prompt's pages, then to the decode server with the lease, which
pulls the pages and answers; its answer is the client's, streamed as it comes.

    python scripts/serve.py --kv-role kv_producer --port 8100 &
    python scripts/serve.py --kv-role kv_consumer --port 8200 &
    python scripts/l15_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200   # on :8000

    curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny-qwen3-v3", "prompt": "The capital of France is", "max_tokens": 8, "stream": true}'

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (the decode server's), GET /health (ok
when both servers are). Once it listens it prints `proxying at URL`. SIGINT or SIGTERM: open requests get
--shutdown-timeout seconds to finish, and it exits 0.
"""
from __future__ import annotations

import contextlib
import signal
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvicorn  # noqa: E402

from lessons.l15_disaggregated.proxy import DEFAULT_TIMEOUT_S, create_proxy  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.errors import CourseError  # noqa: E402


def parser() -> OneLineParser:
    p = OneLineParser(prog="l15_proxy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", required=True, help="the prefill server's URL (serve.py --kv-role kv_producer)")
    p.add_argument("--decode", required=True, help="the decode server's URL (serve.py --kv-role kv_consumer)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: 8000)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for either server's next bytes before a 504 (default: {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds open requests get to finish after SIGTERM (default: 10)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default: warning)")
    return p


class Server(uvicorn.Server):
    """uvicorn's, printing where it serves once it listens, and exiting 0 on SIGTERM (as serve.py's)."""

    def __init__(self, config: uvicorn.Config, banner: str):
        super().__init__(config)
        self.banner = banner

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.banner, flush=True)

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def check_url(url: str, flag: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CourseError(f"{flag} {url!r}: give the server's URL, e.g. http://127.0.0.1:8100")
    try:
        parts.port  # noqa: B018  (a bad port raises here)
    except ValueError:
        raise CourseError(f"{flag} {url!r}: the port is not a number in [0, 65535]") from None
    return url


def build(args) -> tuple[Server, socket.socket]:
    prefill, decode = check_url(args.prefill, "--prefill"), check_url(args.decode, "--decode")
    if not 0 <= args.port < 65536:
        raise CourseError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 < args.timeout < float("inf"):
        raise CourseError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not args.shutdown_timeout >= 0:
        raise CourseError(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout}")
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise CourseError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as serve.py's: no SSE event waits for an ACK
    host, port = sock.getsockname()[:2]
    app = create_proxy(prefill, decode, args.timeout)
    config = uvicorn.Config(app, log_level=args.log_level, loop="asyncio", http="h11",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    url_host = f"[{host}]" if ":" in host else host
    return Server(config, f"proxying at http://{url_host}:{port}/v1 (prefill {prefill}, decode {decode})"), sock


def main() -> None:
    args = parser().parse_args()
    try:
        server, sock = build(args)
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()

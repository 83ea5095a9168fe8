"""A server as a child process: start it on a free loopback port, wait until it answers (with a deadline), stop
it, and read its log back to explain a failure.

By default the server is scripts/serve.py, started as a user starts it (another tree's serve.py for a
benchmark's "before" server); it answers once it prints `serving NAME at URL`, and prints the backend and
threads its engine really uses on a line before that (`engine()` reads it back for a conditions line). Any
other server (HF's `transformers serve`) is a command and a URL, ready when GET /health answers 200. Used by
the smoke script, the L9 benchmarks and the tests, so all of them exercise the server the same way.
"""
from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SERVE = Path(__file__).resolve().parents[1] / "scripts" / "serve.py"
BANNER = re.compile(r"^serving (\S+) at (http://\S+/v1)\s*$", re.M)
ENGINE = re.compile(r"^engine: (.+)$", re.M)  # "engine: backend cpp · threads 1 · device cpu · dtype float32"


def exit_on_sigterm() -> None:
    """A SIGTERM to the caller (a benchmark stopped by `kill`) exits through SystemExit, so `finally` blocks and
    atexit stop its servers; Python's default would end the caller at once and leave them running, in a
    session of their own that no terminal signal reaches. Only where SIGTERM still has its default action."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def free_port() -> int:
    """A port free now on 127.0.0.1, for a server whose own port 0 would not say which one it took."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str] = (), threads: int = 1, startup_timeout: float = 180.0, serve: Path = SERVE,
                 *, cmd: list[str] | None = None, url: str = "", model: str = "", env: dict | None = None,
                 label: str = "serve.py", ready_path: str = "/health"):
        self.threads, self.startup_timeout, self.label = threads, startup_timeout, label
        self.cmd = cmd or [sys.executable, str(serve), "--port", "0", "--threads", str(threads), *args]
        self.by_banner = cmd is None  # serve.py says where it serves; another server is asked GET ready_path
        self.ready_path = ready_path  # a path from the server's root; llama-cpp-python's has no /health
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.url, self.model = url, model
        self.proc: subprocess.Popen | None = None
        # stdout and stderr, read back by path (a second file description: reading never moves the child's offset)
        self.log = tempfile.NamedTemporaryFile(mode="w+", prefix=f"server_{label}_", suffix=".log")

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stderr_tail(self, lines: int = 5) -> str:
        return " | ".join(self.log_text().strip().splitlines()[-lines:])

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)  # a Ctrl-C in the terminal reaches us, not it
        atexit.register(self.kill)  # a caller that dies before stop() must not leave a server behind
        exit_on_sigterm()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.ready():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with status {self.proc.returncode}: {self.stderr_tail()}")
            time.sleep(0.05 if self.by_banner else 0.25)
        self.kill()
        raise RuntimeError(f"{self.label} did not answer within {self.startup_timeout:.0f} s: {self.stderr_tail()}")

    def ready(self) -> bool:
        if self.by_banner:
            if match := BANNER.search(self.log_text()):
                self.model, self.url = match.groups()
            return match is not None
        import httpx

        try:
            return httpx.get(self.url.removesuffix("/v1") + self.ready_path, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def engine(self) -> dict[str, str]:
        """What serve.py printed about its engine: {"backend": "cpp", "threads": "1", ...}; {} for another server."""
        match = ENGINE.search(self.log_text())
        return dict(p.split(" ", 1) for p in match.group(1).split(" · ")) if match else {}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, as a process manager would; its exit status (killed after `timeout`: -9)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def servers_running(args_by_name: dict[str, list[str]], startup_timeout: float = 240.0) -> Iterator[dict]:
    """serve.py once per entry, all started at once (each takes seconds); on leaving, all stopped with SIGTERM at
    once, and each must have exited 0. A server that failed to start raises RuntimeError naming it."""
    with ThreadPoolExecutor(len(args_by_name)) as pool:
        futures = {name: pool.submit(ServerProcess(args).start) for name, args in args_by_name.items()}
        started, errors = {}, []
        for name, future in futures.items():
            try:
                started[name] = future.result(timeout=startup_timeout)
            except Exception as e:
                errors.append(f"{name}: {e}")
    try:
        if errors:
            raise RuntimeError("; ".join(errors))
        yield started
    finally:
        with ThreadPoolExecutor(max(len(started), 1)) as pool:
            statuses = dict(zip(started, pool.map(lambda proc: proc.stop(timeout=30), started.values())))
    if statuses != {name: 0 for name in started}:
        raise RuntimeError(f"exit statuses after SIGTERM: {statuses}")

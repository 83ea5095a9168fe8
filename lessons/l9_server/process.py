"""scripts/serve.py as a child process: start it on a free loopback port, wait for its banner, stop it.

Used by the smoke script and the tests, so both exercise the server exactly as a user starts it.
"""
from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SERVE = Path(__file__).resolve().parents[2] / "scripts" / "serve.py"
BANNER = re.compile(r"^serving (\S+) at (http://\S+/v1)$")


class ServerProcess:
    def __init__(self, args: list[str], threads: int = 1, startup_timeout: float = 180.0, serve: Path = SERVE):
        self.args, self.threads, self.startup_timeout = args, threads, startup_timeout
        self.serve = serve  # another tree's serve.py (a benchmark's "before" server), else this tree's
        self.proc: subprocess.Popen | None = None
        self.url = self.model = ""
        self.log = tempfile.TemporaryFile(mode="w+")  # stderr: read back only to explain a failure

    def start(self) -> "ServerProcess":
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, str(self.serve), "--port", "0", "--threads", str(self.threads), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        atexit.register(self.kill)  # a caller that dies before stop() must not leave a server behind
        lines: list[str] = []

        def pump() -> None:  # a thread of its own: a read on the pipe never blocks the deadline loop below
            for line in self.proc.stdout:
                lines.append(line)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            for line in lines:
                if match := BANNER.match(line.strip()):
                    self.model, self.url = match.groups()
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve.py exited with status {self.proc.returncode}: {self.stderr_tail()}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"serve.py printed no banner within {self.startup_timeout:.0f} s: {self.stderr_tail()}")

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

    def stderr_tail(self, lines: int = 5) -> str:
        self.log.seek(0)
        return " | ".join(self.log.read().strip().splitlines()[-lines:])

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""`salaserve serve` as a subprocess for a benchmark run, ready the way the platform checks it:
`GET /health` answers 2xx and `GET /v1/models` lists a model (serving_protocol.md section 3).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import salaserve

# The checkout this code runs from, so the server is the same code as the runner.
PACKAGE_ROOT = str(Path(salaserve.__file__).resolve().parent.parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_ready(url: str, timeout_s: float = 5.0) -> bool:
    try:  # urlopen raises on any status >= 400
        with urllib.request.urlopen(url + "/health", timeout=timeout_s):
            pass
        with urllib.request.urlopen(url + "/v1/models", timeout=timeout_s) as r:
            return bool(json.loads(r.read()).get("data"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ServeProcess:
    """Start with `start()`, stop with `stop()` (or use as a context manager)."""

    def __init__(self, model: str, server_args: str = "", log_path: str | Path | None = None,
                 start_timeout_s: float = 900.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "salaserve.cli", "serve", "--model-path", model,
                    *shlex.split(server_args), "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = Path(log_path) if log_path else None
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.startup_s: float | None = None  # from the launch to ready

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]

    def start(self) -> ServeProcess:
        self._log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
        t0 = time.monotonic()
        deadline = t0 + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if server_ready(self.url):
                self.startup_s = time.monotonic() - t0
                return self
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server not ready after {self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""Starting `salaserve serve` as a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

# CPU, fp32, torch kernels: what the tiny-model tests run on everywhere.
CPU_ARGS = ("--device", "cpu", "--dtype", "float32", "--backend", "torch")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: str):
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def server_info(self) -> dict:
        return httpx.get(self.url + "/get_server_info", timeout=10).json()

    def counters(self) -> dict:
        """The engine's resource counters and queue lengths, from /get_server_info."""
        st = self.server_info()["internal_states"][0]
        keys = ("pages_used", "compressed_entries", "slots_used", "num_running_reqs", "num_queue_reqs")
        return {k: st[k] for k in keys}


def wait_healthy(server: ServerProcess, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not healthy after {timeout} s:\n{server.log()[-4000:]}")


@contextlib.contextmanager
def run_server(args: list[str], log_dir: str, env: dict | None = None):
    """`salaserve serve ARGS --port <free>`; yields a healthy ServerProcess, stops it after."""
    port = free_port()
    log_path = os.path.join(log_dir, f"server-{port}.log")
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "salaserve.cli", "serve", *args, "--port", str(port)]
    # this checkout's salaserve, whatever is installed
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": path, **(env or {})})
    server = ServerProcess(proc, port, log_path)
    try:
        wait_healthy(server)
        yield server
    finally:
        stop_process(proc)
        log.close()


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tiny_server_args(model_dir: str, *extra: str) -> list[str]:
    return ["--model-path", model_dir, *CPU_ARGS, *extra]

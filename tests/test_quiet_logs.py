"""Quiet, true logs: no third-party warnings that suggest breakage from `serve`, `generate` and
`LLM()` (transformers knows the model type), a warm-up line that says what ran, and a port in use
reported once, without a false shutdown message after it."""

import logging
import os
import socket
import subprocess
import sys
import time

from server_utils import REPO_ROOT

from salaserve.config import EngineArgs
from salaserve.server.engine_client import EngineClient

# What transformers printed when it did not know 'minicpm_sala' (issue 44, point 2).
NOISE = ("You are using a model of type", "to instantiate a model of type", "rope_scaling",
         "FutureWarning", "can yield errors")


def run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT, "PYTHONWARNINGS": "default"})


def assert_quiet(text: str) -> None:
    found = [n for n in NOISE if n in text]
    assert not found, f"{found} in:\n{text[-3000:]}"


def test_generate_on_the_default_model_is_quiet():
    r = run(["-m", "salaserve.cli", "generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "4",
             "--device", "cpu"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("def fibonacci(n):")
    assert_quiet(r.stderr)


def test_llm_and_its_tokenizer_are_quiet(tiny_model_dir):
    """The tiny checkpoint's config.json has the real model's auto_map; without remote code the
    registered config class parses it."""
    code = ("import sys; from salaserve import LLM; llm = LLM(sys.argv[1], device='cpu'); "
            "print(type(llm.tokenizer).__name__, llm.encode('hello')[:1])")
    r = run(["-c", code, tiny_model_dir])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "[1]"  # BOS first, as SGLang tokenizes text
    assert_quiet(r.stderr)


def test_registered_config_parses_the_model_type(tiny_model_dir):
    from transformers import AutoConfig

    from salaserve.model.hf_tokenizer import MiniCPMSALAConfig, register_config

    register_config()
    register_config()  # idempotent
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    assert isinstance(cfg, MiniCPMSALAConfig) and cfg.model_type == "minicpm_sala"
    assert cfg.max_position_embeddings == 65536 and cfg.sparse_config["block_size"] == 16


def test_server_log_is_quiet_and_the_warm_up_line_says_what_ran(tiny_server):
    log = tiny_server.log()
    assert_quiet(log)
    warm_up = [line for line in log.splitlines() if "warm-up done" in line]
    assert len(warm_up) == 1
    assert "tokens generated in" in warm_up[0] and "'" not in warm_up[0]  # counts, not model text


def test_port_in_use_is_one_clear_error(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = run(["-m", "salaserve.cli", "serve", "--model-path", tiny_model_dir, "--device", "cpu",
                 "--port", str(port)], timeout=120)
        elapsed = time.monotonic() - t0
    assert r.returncode == 1
    assert f"salaserve serve: error: cannot listen on 127.0.0.1:{port}: address already in use" in r.stderr
    assert "did not stop" not in r.stderr and "engine" not in r.stderr  # no engine was started
    assert elapsed < 60


class StartingProcess:
    """An engine process still loading its model: alive until terminated."""

    def __init__(self):
        self.alive, self.calls = True, []

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        self.calls.append(("join", timeout))

    def terminate(self):
        self.calls.append(("terminate",))
        self.alive = False

    def kill(self):
        self.calls.append(("kill",))
        self.alive = False


def test_stopping_an_engine_that_is_still_starting_is_not_a_timeout(caplog):
    client = EngineClient(EngineArgs())
    client.process = process = StartingProcess()
    with caplog.at_level(logging.INFO, logger="salaserve.server"):
        client.close()
    assert process.calls[0] == ("terminate",)  # no 10 s wait for a shutdown it cannot read
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["stopping the engine process before it finished starting"]
    assert client.process is None

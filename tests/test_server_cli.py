"""`salaserve serve` flags (SGLang's launch line parses), the README's first command on a fresh
machine (no --model-path: the built-in default model), and a dying engine taking the server down
with a clear exit status instead of leaving it half alive."""

import json
import os
import shutil
import signal
import subprocess
import sys

import httpx
import pytest
from server_utils import REPO_ROOT, run_server

from salaserve.server.args import parse_args

# The SOAR platform's launch line (entrypoint.sh with the default SGLANG_SERVER_ARGS).
PLATFORM_LINE = ("--model-path /models/sala --trust-remote-code --port 30000 --disable-radix-cache "
                 "--attention-backend minicpm_flashinfer --chunked-prefill-size 8192 --skip-server-warmup "
                 "--dense-as-sparse --tp-size 1 --max-running-requests 32 --enable-metrics").split()


def test_platform_launch_line_parses():
    engine, server, notices = parse_args(PLATFORM_LINE)
    assert server.model_path == "/models/sala" and server.port == 30000 and server.host == "127.0.0.1"
    assert server.model_name == "/models/sala"  # /v1/models id defaults to the model path
    assert server.enable_metrics and server.skip_server_warmup and server.trust_remote_code
    assert engine.max_running_requests == 32 and engine.chunked_prefill_size == 8192
    assert len(notices) == 2 and all(n.startswith("note: --") for n in notices)  # one line per ignored flag
    assert engine.prefix_cache_slots == 0  # --disable-radix-cache: no prefix cache, as in SGLang


def test_flags_map_to_engine_and_server_args():
    engine, server, notices = parse_args([
        "--model-path", "m", "--served-model-name", "sala", "--host", "0.0.0.0", "--context-length", "4096",
        "--mem-fraction-static", "0.8", "--api-key", "k", "--quantization", "fp8", "--kv-cache-dtype", "auto",
        "--load-format", "dummy", "--log-level", "warning", "--device", "cpu", "--dtype", "float32",
        "--backend", "torch", "--max-total-tokens", "2048"])
    assert server.model_name == "sala" and server.host == "0.0.0.0" and server.api_key == "k"
    assert server.to_dict()["api_key"] == "***"
    assert (engine.context_length, engine.mem_fraction_static, engine.quantization, engine.load_format) == \
        (4096, 0.8, "fp8", "dummy")
    assert (engine.device, engine.dtype, engine.backend, engine.max_total_tokens) == ("cpu", "float32", "torch", 2048)
    assert notices == []  # unknown flags are errors (tests/test_server_flags.py)
    assert engine.prefix_cache_slots == 4 and engine.prefix_cache_min_tokens == 256  # the defaults
    engine, _, _ = parse_args(["--prefix-cache-slots", "2", "--prefix-cache-min-tokens", "64"])
    assert engine.prefix_cache_slots == 2 and engine.prefix_cache_min_tokens == 64
    assert not engine.quantize_lm_head
    engine, _, _ = parse_args(["--quantization", "w4a16", "--quantize-lm-head"])
    assert engine.quantization == "w4a16" and engine.quantize_lm_head


def test_kernel_option_flags_become_kernel_options():
    """--w4-wgmma / --plan-cache-dir / --parallel-compile reach the kernels as one KernelOptions."""
    from salaserve.kernels.options import KernelOptions

    engine, _, _ = parse_args(["--no-w4-wgmma", "--plan-cache-dir", "/tmp/plans", "--no-parallel-compile",
                               "--w4a16-prefill", "bf16"])
    assert KernelOptions.from_engine_args(engine) == KernelOptions(
        w4_wgmma=False, w4a16_prefill="bf16", plan_cache_dir="/tmp/plans", parallel_compile=False)
    engine, _, _ = parse_args(["--plan-cache-dir", "off"])
    opts = KernelOptions.from_engine_args(engine)
    assert opts.plan_dir() is None and opts.w4_wgmma and opts.parallel_compile and opts.w4a16_prefill == "fp8"


@pytest.mark.parametrize("argv", [["--tp-size", "0"], ["--tp-size", "2", "--dp-size", "2"],
                                  ["--max-running-requests", "0"], ["--backend", "cuda"],
                                  ["--port", "http"], ["--quantize-lm-head"], ["--dp-size", "0"]])
def test_unservable_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_dp_size_parses_and_more_replicas_than_gpus_is_a_clear_error(tiny_model_dir, capsys):
    assert parse_args([])[1].dp_size == 1
    assert parse_args(["--dp-size", "2"])[1].dp_size == parse_args(["--data-parallel-size", "2"])[1].dp_size == 2
    from salaserve.server.launch import run

    import torch

    # more replicas than visible GPUs; a named GPU is one device, not N
    for device in ("cuda", "cuda:0") if torch.cuda.device_count() < 2 else ("cuda:0",):
        assert run(["--model-path", tiny_model_dir, "--dp-size", "2", "--device", device]) == 2
        err = capsys.readouterr().err
        assert "salaserve serve: error: " in err and "--dp-size 2" in err


def test_missing_model_dir_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "salaserve.cli", "serve", "--model-path", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                       env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert r.returncode == 2 and "not a model directory" in r.stderr


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """`salaserve serve` exactly as the README's first command: no flags but the port."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    with run_server([], str(tmp_path_factory.mktemp("logs")), env={"XDG_CACHE_HOME": str(cache)}) as s:
        yield s, str(cache)


def test_readme_first_command_serves_the_default_model(default_server):
    server, cache = default_server
    model_id = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    from salaserve.model.default import PACKAGED

    if os.path.isfile(os.path.join(PACKAGED, "config.json")):
        assert os.path.samefile(model_id, PACKAGED)  # the trained model shipped in the package
    else:
        assert model_id.startswith(os.path.join(cache, "salaserve"))  # written to the user's cache
    body = json.dumps({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}})
    if shutil.which("curl"):
        out = subprocess.run(["curl", "-s", server.url + "/generate", "-H", "Content-Type: application/json",
                              "-d", body], capture_output=True, text=True, timeout=120).stdout
    else:
        out = httpx.post(server.url + "/generate", content=body, timeout=120).text
    reply = json.loads(out)
    assert reply["text"] and reply["meta_info"]["completion_tokens"] >= 1


def test_engine_death_stops_the_server(default_server):
    server, _ = default_server
    engine_pids = [int(p) for p in open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read().split()]
    engine = [p for p in engine_pids if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(engine) == 1
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/generate", json={"text": "x", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            os.kill(engine[0], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert any("error" in json.loads(line[6:]) for line in rest[:-1])  # the stream says why it ended
    assert server.proc.wait(30) == 1
    assert "engine process exited unexpectedly" in server.log()


def test_engine_start_failure_exits_with_status_1(tmp_path):
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "minicpm_sala"}')
    r = subprocess.run([sys.executable, "-m", "salaserve.cli", "serve", "--model-path", str(bad), "--port", "0",
                        "--device", "cpu"], capture_output=True, text=True, timeout=180, cwd=REPO_ROOT,
                       env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert r.returncode == 1, r.stderr[-2000:]
    assert "salaserve serve: stopped:" in r.stderr


def test_cache_report_flag_fills_openai_usage():
    """--enable-cache-report (SGLang's flag): OpenAI usage carries prompt_tokens_details.cached_tokens,
    one count per distinct prompt (n samples of a prompt share it); without it, details are null."""
    from types import SimpleNamespace

    from salaserve.server.responses import group_usage

    _, server, notices = parse_args(["--enable-cache-report"])
    assert server.enable_cache_report and not notices
    assert not parse_args([])[1].enable_cache_report
    shared, other = [1] * 300, [2] * 50
    seqs = [SimpleNamespace(prompt_ids=shared, prompt_tokens=300, completion_tokens=4, cached_tokens=256),
            SimpleNamespace(prompt_ids=shared, prompt_tokens=300, completion_tokens=5, cached_tokens=300),
            SimpleNamespace(prompt_ids=other, prompt_tokens=50, completion_tokens=1, cached_tokens=0)]
    assert group_usage(seqs, True) == {"prompt_tokens": 350, "completion_tokens": 10, "total_tokens": 360,
                                       "prompt_tokens_details": {"cached_tokens": 300}, "reasoning_tokens": 0}
    assert group_usage(seqs)["prompt_tokens_details"] is None

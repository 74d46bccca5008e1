"""`salaserve serve` flags as SGLang treats them: unknown flags are errors with a did-you-mean, the
SGLang flags that do not apply here are accepted with a notice (one explicit list, checked against
SGLang's own), --context-length above the model's limit is refused unless
SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set, and --allow-auto-truncate cuts over-long
requests as SGLang does instead of refusing them."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import httpx
import pytest
from server_utils import REPO_ROOT, run_server, tiny_server_args

from salaserve.server.args import parse_args
from salaserve.server.launch import ALLOW_LONGER_CONTEXT_ENV, context_length_error, env_flag
from salaserve.server.sglang_flags import FLAG, IGNORED_SGLANG_FLAGS, SGLANG_ONLY_POLICIES, VALUES


def serve(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "salaserve.cli", "serve", *argv], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT, **(env or {})})


# ---- unknown and ignored flags ---------------------------------------------------------------
def test_mistyped_flag_is_an_error_with_a_suggestion(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--max-runing-requests", "4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-runing-requests 4" in err
    assert "did you mean --max-running-requests?" in err


def test_unknown_flag_without_a_close_match_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--enable-lora", "--some-future-flag", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --enable-lora --some-future-flag x" in err and "did you mean" not in err


def test_quantization_flag_names_every_format_and_refuses_others(capsys):
    from salaserve.quant.formats import quantization_choices
    for name in quantization_choices():
        assert parse_args(["--quantization", name])[0].quantization == name
    with pytest.raises(SystemExit) as e:
        parse_args(["--quantization", "int3"])
    assert e.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert "{" + ",".join(quantization_choices()) + "}" in help_text  # the metavar keeps up with the registry


def test_mistyped_flag_exits_2_before_anything_starts():
    r = serve("--max-runing-requests", "4", "--port", "0")
    assert r.returncode == 2
    assert "did you mean --max-running-requests?" in r.stderr and "Started server" not in r.stderr


def ignored_flag_argv(flag: str) -> list[str]:
    arity = IGNORED_SGLANG_FLAGS[flag].arity
    return [flag] if arity == FLAG else [flag, "1", "2"] if arity == VALUES else [flag, "x"]


@pytest.mark.parametrize("flag", list(IGNORED_SGLANG_FLAGS))
def test_each_ignored_sglang_flag_parses_with_one_notice(flag):
    _, _, notices = parse_args(ignored_flag_argv(flag))
    assert notices == [f"note: {flag} is accepted for SGLang compatibility and ignored: "
                       f"{IGNORED_SGLANG_FLAGS[flag].why}"]


def test_all_ignored_flags_at_once_change_nothing():
    argv = [x for flag in IGNORED_SGLANG_FLAGS for x in ignored_flag_argv(flag)]
    engine, server, notices = parse_args(argv)
    plain_engine, plain_server, _ = parse_args([])
    assert engine == plain_engine and server == plain_server
    assert len(notices) == len(IGNORED_SGLANG_FLAGS)


@pytest.mark.parametrize("value,order,noticed", [("fcfs", "fcfs", False), ("lof", "lof", False), ("lpm", "fcfs", True),
                                                ("dfs-weight", "fcfs", True)])
def test_schedule_policy(value, order, noticed):
    """fcfs and lof are admission orders here; SGLang's other policies run as fcfs, with a notice."""
    engine, _, notices = parse_args(["--schedule-policy", value])
    assert engine.schedule_policy == order
    assert [n for n in notices if "--schedule-policy" in n] == (
        [f"note: --schedule-policy {value} is accepted for SGLang compatibility and runs as fcfs "
         "(priority, then arrival)"] if noticed else [])
    assert parse_args([])[0].schedule_policy == "fcfs"


def test_schedule_policy_values_are_sglangs():
    source = sglang_server_args_source()
    if source is None:
        pytest.skip("sglang is not installed (pip install sglang==0.5.9 --no-deps)")
    for policy in ("fcfs", "lof", *SGLANG_ONLY_POLICIES):
        assert f'"{policy}"' in source, policy


def test_unknown_schedule_policy_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--schedule-policy", "sjf"])
    assert e.value.code == 2 and "--schedule-policy" in capsys.readouterr().err


def sglang_server_args_source() -> str | None:
    spec = importlib.util.find_spec("sglang")  # located, not imported (its imports need its runtime)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "srt", "server_args.py")
    return open(path, encoding="utf-8").read() if os.path.isfile(path) else None


def test_ignored_flags_are_sglang_flags():
    """Every ignored flag but the SOAR copy's own (--dense-as-sparse) is one of upstream SGLang's."""
    source = sglang_server_args_source()
    if source is None:
        pytest.skip("sglang is not installed (pip install sglang==0.5.9 --no-deps)")
    missing = [f for f, spec in IGNORED_SGLANG_FLAGS.items() if not spec.soar_only and f'"{f}"' not in source]
    assert not missing
    assert '"--allow-auto-truncate"' in source and '"--context-length"' in source


# ---- --context-length above the model's limit -------------------------------------------------
def test_context_length_above_the_model_needs_the_override(tiny_model_dir):
    # the tiny model's max_position_embeddings is 65536
    assert context_length_error(None, tiny_model_dir, False) is None
    assert context_length_error(65536, tiny_model_dir, False) is None
    error = context_length_error(131072, tiny_model_dir, False)
    assert "131072" in error and "65536" in error and f"{ALLOW_LONGER_CONTEXT_ENV}=1" in error
    assert context_length_error(131072, tiny_model_dir, True) is None


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("Yes", True), ("y", True), ("0", False),
                                       ("false", False), ("", False)])
def test_override_reads_sglang_booleans(value, on, monkeypatch):
    monkeypatch.setenv(ALLOW_LONGER_CONTEXT_ENV, value)
    assert env_flag(ALLOW_LONGER_CONTEXT_ENV) is on


def test_cli_refuses_then_allows_a_longer_context(tiny_model_dir):
    with socket.socket() as busy:  # a port in use: an allowed start stops right after the check
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        argv = ("--model-path", tiny_model_dir, "--context-length", "131072", "--port", port)
        refused = serve(*argv, env={ALLOW_LONGER_CONTEXT_ENV: ""})
        allowed = serve(*argv, env={ALLOW_LONGER_CONTEXT_ENV: "1"})
    assert refused.returncode == 2
    assert "--context-length 131072 is greater than the model's max_position_embeddings (65536)" in refused.stderr
    assert allowed.returncode == 1 and "already in use" in allowed.stderr  # got past the check
    assert "greater than the model's max_position_embeddings" in allowed.stderr  # as a warning


# ---- --allow-auto-truncate ------------------------------------------------------------------------
CONTEXT = 64


@pytest.fixture(scope="module")
def truncating_server(tiny_model_dir, tmp_path_factory):
    args = tiny_server_args(tiny_model_dir, "--context-length", str(CONTEXT), "--allow-auto-truncate",
                            "--skip-server-warmup", "--max-running-requests", "4")
    with run_server(args, str(tmp_path_factory.mktemp("logs"))) as s:
        with httpx.Client(base_url=s.url, timeout=120) as client:
            yield s, client


def test_over_long_prompt_keeps_its_first_tokens(truncating_server):
    """SGLang (tokenizer_manager._validate_one_request): `del input_ids[context_len:]`, then
    max_new_tokens = max(0, context - input): the prompt's head is kept, nothing is generated."""
    server, client = truncating_server
    ids = [(7 * i) % 200 + 10 for i in range(CONTEXT + 40)]
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 8},
                                       "return_logprob": True, "logprob_start_len": 0})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["prompt_tokens"] == CONTEXT - 1
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[:CONTEXT - 1]  # the first tokens
    assert meta["completion_tokens"] == 0
    assert "longer than the model's context length (64 tokens). Truncating the input." in server.log()


def test_max_new_tokens_is_lowered_to_what_the_context_leaves(truncating_server):
    _, client = truncating_server
    ids = list(range(10, 50))
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 100,
                                                                             "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["prompt_tokens"] == 40 and meta["completion_tokens"] == CONTEXT - 1 - 40
    assert meta["finish_reason"] == {"type": "length", "length": CONTEXT - 1 - 40}


def test_openai_max_tokens_above_the_context_is_truncated_not_refused(truncating_server):
    _, client = truncating_server
    r = client.post("/v1/completions", json={"model": "m", "prompt": [5] * 20, "max_tokens": 1000,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == CONTEXT - 1 - 20
    r = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1000, "ignore_eos": True,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT - 1


def context_state(auto_truncate: bool):
    """The server's length rule alone: a ServerState whose engine reports a 64-token context."""
    from salaserve.config import EngineArgs
    from salaserve.server.args import ServerArgs
    from salaserve.server.state import ServerState

    state = ServerState(ServerArgs(allow_auto_truncate=auto_truncate), EngineArgs())
    state.client.replicas[0].info = {"context_length": CONTEXT}  # (the engine as replica 0 reports it)
    return state


def test_without_the_flag_over_long_requests_are_refused():
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.server.protocol import ApiError

    state = context_state(False)
    with pytest.raises(ApiError) as e:
        state.fit_to_context([5] * CONTEXT, SamplingParams(max_new_tokens=1))
    assert e.value.status == 400 and "longer than the model's context length" in str(e.value)
    with pytest.raises(ApiError) as e:
        state.fit_to_context([5] * 40, SamplingParams(max_new_tokens=24))
    assert e.value.status == 400 and "exceeds the model's maximum context length" in str(e.value)
    params = SamplingParams(max_new_tokens=23)
    assert state.fit_to_context([5] * 40, params) == [5] * 40 and params.max_new_tokens == 23  # fits exactly


def test_truncation_rule():
    from salaserve.core.sampling_params import SamplingParams

    state = context_state(True)
    ids = list(range(100))
    params = SamplingParams(max_new_tokens=8, min_new_tokens=4)
    assert state.fit_to_context(ids, params) == ids[:CONTEXT - 1]
    assert (params.max_new_tokens, params.min_new_tokens) == (0, 0)
    params = SamplingParams(max_new_tokens=None)
    assert state.fit_to_context(ids[:10], params) == ids[:10] and params.max_new_tokens == CONTEXT - 10

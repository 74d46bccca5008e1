"""The SOAR submission, drop-in: `salaserve soar-package` writes the toolkit's folder; sourcing its
prepare_env.sh into a fresh environment makes the platform's own launch line,
`python3 -m sglang.launch_server ... $SGLANG_SERVER_ARGS ...`, start salaserve, which the official
`sglang.bench_serving` client then drives. The `sglang.launch_server` redirect coexists with a
real sglang package and works where none is installed.

The fresh environment: a new venv (no pip of its own) whose only other packages come from a
read-only "base image" directory of links to this interpreter's site-packages, without salaserve.
So the test installs nothing from the network, takes seconds, and salaserve can only come from
the submission's wheel. sglang is in that base, as in the SOAR image.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv

import httpx
import pytest
from server_utils import REPO_ROOT, ServerProcess, free_port, stop_process, wait_healthy

from salaserve.soar import package
from salaserve.soar.shim import PTH_NAME, PTH_TEXT
from salaserve.soar.sglang_redirect import LAUNCHER

PLATFORM_SERVER_ARGS = ("--disable-radix-cache --attention-backend minicpm_flashinfer --chunked-prefill-size 8192 "
                        "--skip-server-warmup --dense-as-sparse")
# entrypoint.sh's launch line, after `source prepare_env.sh` (serving_protocol.md section 3)
PLATFORM_LAUNCH = ('exec python3 -m sglang.launch_server --model-path "$MODEL" --trust-remote-code --port "$PORT" '
                   '$SGLANG_SERVER_ARGS --tp-size 1 --max-running-requests 32 --enable-metrics')
CLIENT_MODULES = ("sglang", "aiohttp", "numpy", "requests", "tqdm", "transformers", "pybase64", "PIL", "datasets")


def clean_env(**extra) -> dict:
    """This process's environment without the checkout on PYTHONPATH: salaserve must come from
    what prepare_env.sh installed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OPENAI_API_KEY", "API_KEY")}
    return {**env, **extra}


# ---- the redirect, in-process semantics -------------------------------------------------------------
def run_python(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env,
                          cwd=REPO_ROOT)


RUN_LAUNCHER = ("import sys, runpy; sys.argv = ['launch_server', '--help']; "
                "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)")


def test_redirect_coexists_with_a_real_sglang():
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("sglang is not installed (pip install sglang==0.5.9 --no-deps)")
    code = ("import importlib.util as u, salaserve.soar.sglang_redirect as r; r.install(); r.install(); "
            "print(u.find_spec('sglang.launch_server').origin); print(u.find_spec('sglang.bench_serving').origin); "
            "import sys; print(sum(isinstance(f, r.LaunchServerRedirect) for f in sys.meta_path))")
    r = run_python(["-c", code], clean_env(PYTHONPATH=REPO_ROOT))
    assert r.returncode == 0, r.stderr
    launch, bench, count = r.stdout.split()
    assert os.path.samefile(launch, LAUNCHER)
    real_sglang = list(spec.submodule_search_locations)[0]
    assert os.path.samefile(bench, os.path.join(real_sglang, "bench_serving.py"))  # the official client
    assert count == "1"
    r = run_python(["-c", "import salaserve.soar.sglang_redirect as r; r.install(); " + RUN_LAUNCHER],
                   clean_env(PYTHONPATH=REPO_ROOT))
    assert r.returncode == 0 and r.stdout.startswith("usage: salaserve serve"), r.stderr


def test_launch_server_works_where_no_sglang_is_installed(tmp_path):
    """No site-packages at all (-S): the .pth, processed as site does, is the only way in."""
    (tmp_path / PTH_NAME).write_text(PTH_TEXT)
    prelude = f"import site; site.addsitedir({str(tmp_path)!r}); "
    env = clean_env(PYTHONPATH=REPO_ROOT)
    r = run_python(["-S", "-c", prelude + "import importlib.util as u; print(u.find_spec('sglang.bench_serving'))"],
                   env)
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr  # nothing else appears under sglang
    r = run_python(["-S", "-c", prelude + RUN_LAUNCHER], env)
    assert r.returncode == 0 and r.stdout.startswith("usage: salaserve serve"), r.stderr
    assert "--dense-as-sparse" in r.stdout


def test_pth_does_nothing_once_salaserve_is_gone(tmp_path):
    (tmp_path / PTH_NAME).write_text(PTH_TEXT)
    r = run_python(["-S", "-c", f"import site; site.addsitedir({str(tmp_path)!r}); import sys; "
                                "print(len(sys.meta_path))"], clean_env())  # salaserve not on the path
    assert r.returncode == 0 and not r.stderr, r.stderr  # no "Error processing line"


# ---- the submission folder ---------------------------------------------------------------------
def test_server_args_are_checked_when_packaging(tmp_path, capsys):
    assert package.main(["--out", str(tmp_path / "pkg"), "--server-args", "--max-runing-requests 4"]) == 2
    err = capsys.readouterr().err
    assert "did you mean --max-running-requests?" in err and "not valid `salaserve serve` flags" in err
    assert not (tmp_path / "pkg").exists()


@pytest.fixture(scope="module")
def submission(tmp_path_factory):
    out = tmp_path_factory.mktemp("submission")
    assert package.main(["--out", str(out), "--quant", "w4a16-rtn", "--server-args", "--log-level info"]) == 0
    return out


def test_folder_has_the_toolkit_layout(submission):
    names = sorted(p.name for p in submission.iterdir())
    assert names == ["README.md", "dist", "prepare_env.sh", "prepare_model.sh"]
    wheels = list((submission / "dist").glob("salaserve-*.whl"))
    assert len(wheels) == 1
    for script in ("prepare_env.sh", "prepare_model.sh"):
        assert subprocess.run(["bash", "-n", str(submission / script)]).returncode == 0
    assert os.access(submission / "prepare_model.sh", os.X_OK)
    env = (submission / "prepare_env.sh").read_text()
    assert wheels[0].name in env and "sglang-shim install" in env
    assert 'export SGLANG_SERVER_ARGS="${SGLANG_SERVER_ARGS:-} --log-level info"' in env
    assert "prepare-model \"$@\" --quant w4a16-rtn" in (submission / "prepare_model.sh").read_text()


def make_fresh_env(root) -> tuple[str, str]:
    """A new venv plus the base image: links to this interpreter's site-packages, less salaserve
    (and the .pth files that would bring it or other checkouts back)."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(str(root / "venv"))
    python = str(root / "venv" / "bin" / "python3")
    base = root / "base-image"
    base.mkdir()
    site = sysconfig.get_paths()["purelib"]
    for name in os.listdir(site):
        if name.startswith(("salaserve", "__editable__", "__pycache__")) or name.endswith(".pth"):
            continue
        os.symlink(os.path.join(site, name), base / name)
    venv_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(venv_site, "base_image.pth"), "w") as f:
        f.write(str(base) + "\n")
    return str(root / "venv"), venv_site


def bench_rows(path) -> list[tuple[str, str]]:
    rows = [("What is the capital of France?", "Paris is the capital and largest city of France."),
            ("def add(a, b):", "    return a + b"),
            ("Explain recursion briefly.", "A function that calls itself on a smaller input until a base case."),
            ("列出三种水果。", "苹果、香蕉和橙子。"),
            ("Say hello.", "placeholder"),
            ("Name a prime number greater than 100.", "101 is prime.")]
    with open(path, "w", encoding="utf-8") as f:
        for q, a in rows:
            f.write(json.dumps({"conversations": [{"role": "user", "content": q},
                                                  {"role": "assistant", "content": a}]}, ensure_ascii=False) + "\n")
    return rows


def test_platform_flow_in_a_fresh_environment(submission, tmp_path):
    """prepare_env.sh sourced, prepare_model.sh run, then the platform's launch line on the
    built-in default model, driven by the official sglang.bench_serving client."""
    missing = [m for m in CLIENT_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"sglang's benchmark client is not installed (missing: {', '.join(missing)})")
    if importlib.util.find_spec("pip") is None and shutil.which("uv") is None:
        pytest.skip("prepare_env.sh needs pip or uv")
    venv_dir, venv_site = make_fresh_env(tmp_path)
    port = free_port()
    log_path = str(tmp_path / "server.log")
    script = "\n".join([
        f"source {venv_dir}/bin/activate",
        f"cd {submission}",
        "source ./prepare_env.sh || exit 10",
        f"bash ./prepare_model.sh --input \"$(python3 -m salaserve.model.default)\" --output {tmp_path}/processed"
        " || exit 11",
        "MODEL=\"$(python3 -m salaserve.model.default)\"",
        PLATFORM_LAUNCH,
    ])
    env = clean_env(SGLANG_SERVER_ARGS=PLATFORM_SERVER_ARGS, PORT=str(port),
                    XDG_CACHE_HOME=str(tmp_path / "cache"))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(tmp_path), stdin=subprocess.DEVNULL)
    server = ServerProcess(proc, port, log_path)
    try:
        wait_healthy(server, timeout=300)
        out = server.log()
        assert "Successfully installed salaserve" in out or "Installed 1 package" in out
        assert f"installed {venv_site}/{PTH_NAME}" in out
        # the platform's SGLang flags were all accepted, the ignored ones said so
        assert "note: --attention-backend is accepted for SGLang compatibility and ignored" in out
        assert "note: --dense-as-sparse is accepted for SGLang compatibility and ignored" in out
        processed = json.loads((tmp_path / "processed" / "config.json").read_text())
        assert processed["quantization_config"]["bits"] == 4  # prepare_model.sh ran prepare-model

        model_id = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        assert model_id.startswith(venv_site)  # the model inside the installed wheel

        rows = bench_rows(tmp_path / "bench.jsonl")
        # the official client, from the fresh environment: the real sglang, not the redirect
        argv = ["-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1", "--port", str(port),
                "--dataset-name", "custom", "--dataset-path", str(tmp_path / "bench.jsonl"),
                "--num-prompts", str(len(rows)), "--flush-cache", "--max-concurrency", "8",
                "--output-file", str(tmp_path / "result.jsonl"), "--output-details"]
        bench = subprocess.run([os.path.join(venv_dir, "bin", "python3"), *argv], capture_output=True, text=True,
                               timeout=600, cwd=str(tmp_path), env=clean_env())
        assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
        m = re.search(r"Benchmark duration \(s\):\s+([0-9.]+)", bench.stdout)
        assert m and float(m.group(1)) > 0, bench.stdout[-3000:]
        assert re.search(rf"Successful requests:\s+{len(rows)}\b", bench.stdout), bench.stdout[-3000:]
        result = json.loads((tmp_path / "result.jsonl").read_text().splitlines()[-1])
        from salaserve.model.hf_tokenizer import load_tokenizer

        tok = load_tokenizer(model_id)
        assert sorted(result["output_lens"]) == sorted(len(tok.encode(a)) for _, a in rows)  # exact lengths
        assert all(not e for e in result["errors"])
    finally:
        stop_process(proc)

"""`salaserve soar-package --out DIR`: a SOAR submission folder that installs salaserve and serves
through the platform's own launch line.

The platform (SOAR-Toolkit README, "Submission"): it sources the folder's prepare_env.sh once the
base image is up, runs `bash prepare_model.sh --input IN --output OUT` when the folder has one,
then launches `python3 -m sglang.launch_server --model-path MODEL ... $SGLANG_SERVER_ARGS ...`.
The folder this writes:

  prepare_env.sh     installs salaserve's wheel (without dependencies, so the image's CUDA torch
                     stays), then only the requirements the image lacks, then the shim that makes
                     `python3 -m sglang.launch_server` start salaserve; appends --server-args to
                     SGLANG_SERVER_ARGS
  prepare_model.sh   with --quant: `salaserve prepare-model --input IN --output OUT --quant Q`
  dist/*.whl         salaserve, built from this checkout

`tar -czf submission.tar.gz -C DIR .` makes the archive the platform takes.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from salaserve.argparsing import ArgumentParser
from salaserve.quant.prepare import METHODS

SOURCE_FILES = ("pyproject.toml", "README.md")

PREPARE_ENV = """\
# salaserve SOAR submission: the environment step (written by `salaserve soar-package`).
# The platform sources this file once its base image is up; afterwards its own launch line,
# `python3 -m sglang.launch_server --model-path ... $SGLANG_SERVER_ARGS ...`, starts salaserve.
_salaserve_prepare_env() {{
    local here python missing
    here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)" || return 1
    python="$(command -v python3)" || {{ echo "prepare_env.sh: no python3 on PATH" >&2; return 1; }}
    # uv where the image has it (the toolkit asks for `uv pip install`), else pip; either into the
    # python3 that the platform launches
    local -a pip
    local reinstall
    if command -v uv >/dev/null 2>&1; then
        pip=(uv pip install --python "$python"); reinstall=--reinstall
    else
        pip=("$python" -m pip install --disable-pip-version-check); reinstall=--force-reinstall
    fi
    # salaserve alone: the image's torch (a CUDA build matched to its driver) and SGLang's
    # packages stay as they are
    "${{pip[@]}}" --no-deps "$reinstall" "$here/dist/{wheel}" || return 1
    # then what salaserve needs and the image lacks (nothing installed is replaced)
    missing="$(mktemp)" || return 1
    "$python" -m salaserve.soar.missing_requirements > "$missing" || {{ rm -f "$missing"; return 1; }}
    if [ -s "$missing" ]; then
        "${{pip[@]}}" -r "$missing" || {{ rm -f "$missing"; return 1; }}
    fi
    rm -f "$missing"
    # `python3 -m sglang.launch_server ...` -> `salaserve serve ...`
    "$python" -m salaserve.cli sglang-shim install || return 1
{export_args}}}
_salaserve_prepare_env
_salaserve_status=$?
unset -f _salaserve_prepare_env
return "$_salaserve_status" 2>/dev/null || exit "$_salaserve_status"
"""

PREPARE_MODEL = """\
#!/usr/bin/env bash
# salaserve SOAR submission: the model step (written by `salaserve soar-package --quant {quant}`).
# The platform runs `bash prepare_model.sh --input ORIGINAL_MODEL --output PROCESSED_MODEL` after
# prepare_env.sh; salaserve then serves the processed model (its format is in its config.json).
set -euo pipefail
exec python3 -m salaserve.cli prepare-model "$@" --quant {quant}
"""

FOLDER_README = """\
# salaserve SOAR submission

Written by `salaserve soar-package` ({command}).

- `prepare_env.sh`: installs `dist/{wheel}` and the shim that makes the platform's
  `python3 -m sglang.launch_server ...` start `salaserve serve` with the same flags.
{model_line}
Archive it with `tar -czf submission.tar.gz -C {folder} .`.
"""


def source_root() -> Path:
    """The checkout salaserve runs from (the wheel is built from it)."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or 'name = "salaserve"' not in pyproject.read_text(encoding="utf-8"):
        raise ValueError(f"salaserve runs from {root}, which is not a source checkout (no salaserve "
                         "pyproject.toml); run soar-package from a checkout (pip install -e .)")
    return root


def build_wheel(root: Path, dist: Path) -> Path:
    """salaserve's wheel from a clean copy of the sources (no caches, nothing written into the
    checkout). Without build isolation where setuptools is installed: no download needed."""
    with tempfile.TemporaryDirectory(prefix="salaserve-src-") as tmp:
        src = Path(tmp) / "salaserve-src"
        src.mkdir()
        for name in SOURCE_FILES:
            shutil.copy2(root / name, src / name)
        shutil.copytree(root / "salaserve", src / "salaserve",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--wheel-dir", str(dist), str(src)]
        if importlib.util.find_spec("setuptools") is not None:
            cmd.insert(-1, "--no-build-isolation")
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building the wheel failed:\n{result.stdout}{result.stderr}")
    wheels = sorted(dist.glob("salaserve-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one salaserve wheel in {dist}, found {[w.name for w in wheels]}")
    return wheels[0]


def check_server_args(server_args: str) -> None:
    """The args must parse as `salaserve serve` flags now rather than fail on the platform."""
    from salaserve.server.args import parse_args

    try:
        parse_args(shlex.split(server_args))
    except SystemExit as e:
        raise ValueError(f"--server-args {server_args!r} are not valid `salaserve serve` flags "
                         "(the error is above)") from e


def write_script(path: Path, text: str, executable: bool) -> None:
    path.write_text(text, encoding="utf-8")
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def write_package(out: Path, quant: str | None, server_args: str, command: str) -> list[Path]:
    """Writes the folder; returns its files."""
    check_server_args(server_args)
    root = source_root()
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    wheel = build_wheel(root, out / "dist")
    export_args = (f'    export SGLANG_SERVER_ARGS="${{SGLANG_SERVER_ARGS:-}} {server_args.strip()}"\n'
                   if server_args.strip() else "")
    write_script(out / "prepare_env.sh", PREPARE_ENV.format(wheel=wheel.name, export_args=export_args), False)
    files = [out / "prepare_env.sh"]
    model_line = ""
    if quant is not None:
        write_script(out / "prepare_model.sh", PREPARE_MODEL.format(quant=quant), True)
        files.append(out / "prepare_model.sh")
        model_line = f"- `prepare_model.sh`: `salaserve prepare-model --quant {quant}` on the platform's model.\n"
    (out / "README.md").write_text(FOLDER_README.format(command=command, wheel=wheel.name, model_line=model_line,
                                                        folder=shlex.quote(str(out))), encoding="utf-8")
    return [*files, out / "README.md", wheel]


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="salaserve soar-package", description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", required=True, help="the submission folder to write (new or empty)")
    p.add_argument("--quant", choices=METHODS, default=None,
                   help="write prepare_model.sh, which quantizes the platform's model with salaserve prepare-model "
                        "(default: no prepare_model.sh; the model is served as given)")
    p.add_argument("--server-args", default="",
                   help="`salaserve serve` flags to append to the platform's SGLANG_SERVER_ARGS, one string")
    a = p.parse_args(argv)
    command = "salaserve soar-package " + " ".join(shlex.quote(x) for x in argv)
    try:
        files = write_package(Path(a.out), a.quant, a.server_args, command)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"salaserve soar-package: error: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f"wrote {f} ({os.path.getsize(f):,} bytes)")
    print(f"archive: tar -czf submission.tar.gz -C {shlex.quote(a.out)} .")
    return 0

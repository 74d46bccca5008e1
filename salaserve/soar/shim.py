"""`salaserve sglang-shim install | remove | status`: the `.pth` file that makes
`python -m sglang.launch_server ...` start salaserve in this Python environment.

A `.pth` file in site-packages runs its `import` lines at every interpreter start; ours puts
`sglang_redirect.LaunchServerRedirect` first on sys.meta_path. It does nothing once salaserve is
uninstalled, and `remove` deletes it. The file name sorts after the `.pth` files that editable
installs use to make salaserve importable, which must run first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

from salaserve.argparsing import ArgumentParser

PTH_NAME = "salaserve_sglang_shim.pth"
PTH_TEXT = """\
# salaserve: `python -m sglang.launch_server` starts salaserve (salaserve sglang-shim remove undoes it)
import importlib.util as _u; _u.find_spec("salaserve") and __import__("salaserve.soar.sglang_redirect", fromlist=["install"]).install()
"""


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def launcher_origin(python: str = sys.executable) -> str | None:
    """The file a fresh `python` finds for sglang.launch_server (None: none), asked in a new
    process so that the .pth files run as they will for the platform."""
    code = "import importlib.util as u; s = u.find_spec('sglang.launch_server'); print(s.origin if s else '')"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or None


def redirected(origin: str | None) -> bool:
    from salaserve.soar.sglang_redirect import LAUNCHER

    return origin is not None and os.path.realpath(origin) == os.path.realpath(LAUNCHER)


def install(site_dir: str) -> int:
    path = os.path.join(site_dir, PTH_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write(PTH_TEXT)
    origin = launcher_origin()
    if not redirected(origin):
        print(f"salaserve sglang-shim: error: wrote {path}, but {sys.executable} -m sglang.launch_server still "
              f"runs {origin or 'nothing'}", file=sys.stderr)
        return 1
    print(f"installed {path}: `{sys.executable} -m sglang.launch_server ...` starts salaserve")
    return 0


def remove(site_dir: str) -> int:
    path = os.path.join(site_dir, PTH_NAME)
    if os.path.exists(path):
        os.remove(path)
        print(f"removed {path}")
    else:
        print(f"no {path}: nothing to remove")
    return 0


def status() -> int:
    origin = launcher_origin()
    if redirected(origin):
        print(f"`{sys.executable} -m sglang.launch_server` starts salaserve")
        return 0
    print(f"`{sys.executable} -m sglang.launch_server` runs {origin or 'nothing (no sglang installed)'}")
    return 1


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="salaserve sglang-shim",
                       description="Make `python -m sglang.launch_server ARGS` run `salaserve serve ARGS` in this "
                                   "Python environment (what the SOAR platform launches), through a .pth file in "
                                   f"site-packages ({site_packages()}). A real sglang package keeps working for "
                                   "everything else.")
    p.add_argument("action", choices=["install", "remove", "status"],
                   help="install or remove the .pth file, or report what sglang.launch_server runs")
    a = p.parse_args(argv)
    if a.action == "install":
        return install(site_packages())
    if a.action == "remove":
        return remove(site_packages())
    return status()

"""An import hook that answers the module `sglang.launch_server` with salaserve's launcher.

Installed at interpreter start by a `.pth` file (`salaserve sglang-shim install`), so that the SOAR
platform's `python -m sglang.launch_server ...` starts salaserve. Only that one module is
redirected: a real `sglang` package, when installed, keeps serving everything else (its
`sglang.bench_serving` client above all). Where no `sglang` is installed, an empty `sglang`
package stands in so that `sglang.launch_server` can be found under it; importing any other
`sglang.*` module then fails as before.

Runs in every interpreter of the environment: standard library only, nothing imported up front.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_server.py")
REDIRECTED = "sglang.launch_server"


class LaunchServerRedirect:
    """A sys.meta_path finder (find_spec is all the import system asks of one)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == REDIRECTED:
            return importlib.util.spec_from_file_location(fullname, LAUNCHER)
        if fullname == "sglang":
            return self._real_sglang(path, target) or importlib.machinery.ModuleSpec(
                "sglang", None, is_package=True)  # an empty namespace package
        return None

    def _real_sglang(self, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec("sglang", path, target)
            if spec is not None:
                return spec
        return None


def install() -> None:
    """Put the redirect first on sys.meta_path (once)."""
    if not any(isinstance(f, LaunchServerRedirect) for f in sys.meta_path):
        sys.meta_path.insert(0, LaunchServerRedirect())

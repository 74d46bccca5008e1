"""pytest plugin: a hash of the sm_90 SASS of every kernel the tests compile ahead of time.

For refactors that must not change any kernel (moving code between modules, renames): record the
hashes before and after, with an empty Triton cache each time so that every kernel is compiled,
then compare. Equal SASS means the GPU runs the same instructions, whatever the source layout.

    rm -rf /tmp/tc && TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=tests:scripts SASS_FP_OUT=before.json \
        python -m pytest -p sass_fingerprint -k sm90 tests/test_kernels_sparse.py tests/test_kv_fp8.py
    (change the code; the same command with SASS_FP_OUT=after.json)
    python scripts/sass_fingerprint.py before.json after.json

Hashes skip line information (nvdisasm -c without -g), so moved source lines do not count.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_RECORDS: list = []


def _sass(cubin: bytes) -> str:
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout


def pytest_configure(config):
    import kernel_checks  # tests/ on PYTHONPATH

    compile_sm90 = kernel_checks.compile_sm90

    def recording(fn, *a, **k):
        kernel = compile_sm90(fn, *a, **k)
        sass = _sass(kernel.asm["cubin"])
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        _RECORDS.append([test, fn.__name__, hashlib.sha1(sass.encode()).hexdigest()[:16], sass.count("\n")])
        return kernel

    kernel_checks.compile_sm90 = recording


def pytest_unconfigure(config):
    out = os.environ.get("SASS_FP_OUT")
    if out:
        Path(out).write_text(json.dumps(_RECORDS, indent=0))


def compare(before: str, after: str) -> int:
    a, b = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())
    differ = [(x, y) for x, y in zip(a, b) if x != y]
    print(f"{len(a)} kernels before, {len(b)} after, {len(differ)} differ")
    for x, y in differ:
        print(f"  {x[0]} {x[1]}: {x[2]} ({x[3]} lines) -> {y[2]} ({y[3]} lines)")
    return int(bool(differ) or len(a) != len(b))


if __name__ == "__main__":
    sys.exit(compare(sys.argv[1], sys.argv[2]))

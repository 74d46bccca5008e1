"""What `python -m sglang.launch_server ARGS` runs once the shim is installed: `salaserve serve
ARGS`, the same flags (salaserve serve takes sglang.launch_server's)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from salaserve.cli import main as salaserve_main

    return salaserve_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

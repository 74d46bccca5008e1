"""What `python -m sglang.launch_server ARGS` runs once the shim is installed: `salaserve serve
ARGS`, the same flags (salaserve serve takes sglang.launch_server's)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import logging

    from salaserve.server.launch import run as serve

    # (as `salaserve serve` sets it up: cli.main)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())

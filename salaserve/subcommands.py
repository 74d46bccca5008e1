"""`prog CMD ...` dispatch, shared by `salaserve` (cli.py) and `salaserve bench` (bench/cli.py)."""

from __future__ import annotations

import sys


def run_subcommand(prog: str, commands: dict, argv: list[str], usage: str) -> int:
    """Dispatch `prog CMD ...` to commands[CMD]; help with no or -h/--help, exit 2 on unknown."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    cmd = commands.get(argv[0])
    if cmd is None:
        print(f"{prog}: unknown command {argv[0]!r}; choose from {', '.join(commands)}", file=sys.stderr)
        return 2
    return cmd(argv[1:])

"""The command line's shared pieces: a parser whose help shows every default and whose errors
suggest the flag that was probably meant, and the dispatch of `prog COMMAND ...` with one help
line per command."""

from __future__ import annotations

import argparse
import copy
import difflib
import sys
from dataclasses import dataclass
from typing import Callable


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks; every option's help ends with its default, options
    without help text included. Defaults of None, False and "" are left out: they mean "not
    given" or "off", which the help text says better."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):
            action = _with_help(action, "default: %(default)s")
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "%(default)" in help_text or not self._shows_default(action):
            return help_text
        return f"{help_text} (default: %(default)s)"

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        default = action.default  # (-h and --version have SUPPRESS)
        return bool(action.option_strings) and not (default is None or default is False
                                                    or default in ("", argparse.SUPPRESS))


def _with_help(action: argparse.Action, help_text: str) -> argparse.Action:
    clone = copy.copy(action)  # the parser's own action stays untouched
    clone.help = help_text
    return clone


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults in the help and a did-you-mean for mistyped flags (exit status 2)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        ns, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(unrecognized_message(unknown, list(self._option_string_actions)))
        return ns


def unrecognized_message(unknown: list[str], known_options: list[str]) -> str:
    """argparse's 'unrecognized arguments' line plus the closest known flag for each unknown one."""
    hints = []
    for token in unknown:
        if not token.startswith("--"):
            continue
        flag = token.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known_options, n=1, cutoff=0.75)
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(unknown)}"
    return message + ("".join(f"\n  {h}" for h in hints) if hints else "")


@dataclass(frozen=True)
class Command:
    run: Callable[[list[str]], int]  # takes the arguments after the command's name
    summary: str  # one line for the command list


def command_list(commands: dict[str, Command]) -> str:
    width = max(len(name) for name in commands) + 2
    return "\n".join(f"  {name:<{width}}{cmd.summary}" for name, cmd in commands.items())


def run_subcommand(prog: str, commands: dict[str, Command], argv: list[str], description: str = "") -> int:
    """Dispatch `prog CMD ...` to commands[CMD]. No arguments or -h/--help: the command list
    (status 2 without arguments, 0 when asked for); an unknown command: a suggestion, status 2."""
    usage = f"usage: {prog} {{{','.join(commands)}}} ...\n"
    if not argv or argv[0] in ("-h", "--help"):
        text = usage + (f"\n{description}\n" if description else "")
        text += f"\ncommands:\n{command_list(commands)}\n\n`{prog} COMMAND --help` shows a command's options."
        print(text, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name = argv[0]
    cmd = commands.get(name)
    if cmd is None:
        close = difflib.get_close_matches(name, list(commands), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"{usage}{prog}: error: unknown command {name!r}{hint}; choose from {', '.join(commands)}",
              file=sys.stderr)
        return 2
    return cmd.run(argv[1:])

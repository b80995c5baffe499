"""Commands that packages above the SDK add to ``hicache-storage``, found by entry point.

The SDK imports nothing from the layers built on it; a package that has a command to offer (the
multi-turn benchmark, which runs the HiCache core, offers ``bench``: see this repository's
pyproject.toml) declares it in the entry-point group ``hicache_storage.commands``::

    [project.entry-points."hicache_storage.commands"]
    mycommand = "mypackage.command:add_parser"

The entry point's name is the command's name. It loads a callable that takes the CLI's
subparsers action, adds that one command to it and sets ``run`` on it with ``set_defaults``.
``run(args)`` returns the exit code, and raises :class:`UsageError` (or a ``StorageError``) for
arguments it cannot use: the CLI prints either as one line and exits 2. Keep the callable's module
cheap to import: it is loaded every time the CLI builds its parser.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

COMMANDS_GROUP = "hicache_storage.commands"


class UsageError(Exception):
    """A command's arguments are unusable: the CLI prints the message as one line and exits 2."""


# --- argparse types a command's options share (a bad value: one line, exit 2) ----------------


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text.strip()!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def positive_rate(text: str) -> float:
    """An argparse ``type``: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text.strip()!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text.strip()}")
    return value


def add_plugin_commands(commands: argparse._SubParsersAction) -> None:
    """Add every command registered under :data:`COMMANDS_GROUP`, in name order.

    A built-in command keeps its name; an entry point that cannot be loaded is reported on stderr
    and left out, so a broken package costs its own command, not the whole CLI.
    """
    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        if entry.name in commands.choices:
            continue
        try:
            add_command = entry.load()
        except Exception as exc:  # any failure of a third party's import: report it, keep the CLI usable
            print(f"hicache-storage: command {entry.name!r} ({entry.value}) cannot be loaded: {exc}", file=sys.stderr)
            continue
        add_command(commands)

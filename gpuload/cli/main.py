"""The ``gpuload`` command: ``gpuload bench`` measures loaders side by side; ``gpuload plan``
prints where a dataset's bytes would live; ``gpuload doctor`` checks what this machine gives
gpuload; ``gpuload cache`` lists or clears the disk tier; ``gpuload trace`` runs a user's loader
and says where its step waits.

Each subcommand is a row of ``COMMANDS``: its name, its help line and the module that defines
it. That module has ``add_arguments(parser)`` and ``run(args) -> int`` and imports nothing heavy
at its top (torch, NumPy's users, DALI: inside ``run`` only), so ``gpuload --help``, ``gpuload
CMD --help`` and every argument error answer at once. Only the named command's module is
imported. A typo gets the command's usage and the closest option or choice.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["main", "Command", "COMMANDS"]

DESCRIPTION = ("gpuload's command line: time loaders side by side (bench), plan memory before a run (plan), "
               "check this machine (doctor), list or clear the disk tier (cache), "
               "show where a loader's step waits (trace).")


@dataclass(frozen=True)
class Command:
    """One ``gpuload`` subcommand; ``module`` defines ``add_arguments(parser)`` and ``run(args)``."""

    name: str
    help: str
    module: str


COMMANDS: tuple[Command, ...] = (
    Command("bench", "time gpuload against torch's DataLoader, side by side", "gpuload.cli.bench"),
    Command("plan", "print where a dataset's bytes would live under a cache budget, or a job's memory",
            "gpuload.cli.plan"),
    Command("doctor", "check the driver, torch, CuPy, DALI, memory and settings gpuload uses", "gpuload.cli.doctor"),
    Command("cache", "list or clear the disk tier's entries in a cache_dir", "gpuload.cli.cache"),
    Command("trace", "run your loader for N steps with a stand-in step: where the step waits, and why",
            "gpuload.cli.trace"),
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose error for a typo suggests the closest choice (difflib)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        chosen = re.search(r"invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if chosen:
            choices = re.findall(r"'(.*?)'", chosen.group(2))
            message += _suggestion(chosen.group(1), choices)
        super().error(message)


def _suggestion(word: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _unknown_arguments(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's "unrecognized arguments" message, with the closest option for the first typo."""
    options = [option for action in parser._actions for option in action.option_strings]
    hint = ""
    for extra in extras:
        if extra.startswith("-"):
            hint = _suggestion(extra.partition("=")[0], options)
            if hint:
                break
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def _negative_values_joined(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--device-memory -80GiB`` as ``--device-memory=-80GiB``: argparse would take ``-80GiB`` for
    an option and say "expected one argument"; joined, the value reaches its type's check."""
    takes_one = {option for action in parser._actions if action.nargs is None and action.option_strings
                 for option in action.option_strings}
    joined: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token in takes_one:
            value = next(tokens, None)
            if value is not None and re.match(r"-[\d.]", value):
                joined.append(f"{token}={value}")
                continue
            joined.append(token)
            if value is not None:
                joined.append(value)
            continue
        joined.append(token)
    return joined


def _chosen(argv: list[str]) -> Command | None:
    """The command argv names (its first word that is not an option), if any."""
    first = next((token for token in argv if not token.startswith("-")), None)
    return next((command for command in COMMANDS if command.name == first), None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpuload`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog="gpuload", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=ArgumentParser)
    chosen = _chosen(argv)
    subparser = None
    for command in COMMANDS:
        added = commands.add_parser(command.name, help=command.help, description=command.help)
        if command is chosen:
            module = importlib.import_module(command.module)
            module.add_arguments(added)
            added.set_defaults(run=module.run)
            subparser = added
    if subparser is not None:
        argv = _negative_values_joined(subparser, argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        (subparser or parser).error(_unknown_arguments(subparser or parser, extras))
    return args.run(args)

"""The ``shardax`` command: ``train`` (the LM job), ``prepare`` (token shards), ``plan`` (what fits,
what it costs), ``launch``, ``export`` (a checkpoint as Hugging Face's), ``generate`` (text).

Each subcommand lives in its own module; this one parses and reports errors: bad input is one
line on stderr and exit code 2, with no traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import NoReturn

from shardax.cli import signals
from shardax.cli.errors import (
    EXIT_BAD_INPUT,
    EXIT_CLUSTER,
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    ClusterError,
    NonFiniteError,
    Preempted,
    UsageError,
    in_flags,
)
from shardax.cli.export import add_export_parser, export_command
from shardax.cli.generate import add_generate_parser, generate_command
from shardax.cli.launch import add_launch_parser, launch_command
from shardax.cli.plan import add_plan_parser, plan_command
from shardax.cli.prepare import add_prepare_parser, prepare_command
from shardax.cli.train import add_train_parser, train
from shardax.errors import Stopped
from shardax.vocabulary import STRATEGY_NAMES


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line like every other bad input (usage stays in --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def main(argv: list[str] | None = None) -> int:
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    signals.install()  # first of all: a signal from here on ends the command in one line
    try:
        try:
            parser, commands = _parser()
            args = parser.parse_args(argv)
            signals.name_command(args.command)
            code = _run(args, commands.choices[args.command])
        except (Stopped, KeyboardInterrupt) as stop:
            signals.end(stop)
        except BaseException:  # raised where a signal's exception became another one
            if not signals.received:
                raise
            signals.end(Stopped(signals.received[-1]))
        if signals.received and code == 0:  # swallowed where it was raised: the command still ends by it
            signals.end(Stopped(signals.received[-1], "(it came where the command could not stop, and the "
                                                      "command ran to its end)"))
        return code
    finally:
        signals.finish()
        for number, handler in previous.items():
            if threading.current_thread() is threading.main_thread():
                signal.signal(number, handler)


def _parser() -> tuple[_Parser, argparse._SubParsersAction]:
    parser = _Parser(prog="shardax", description="Train Flax NNX models across devices and hosts.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_train_parser(subparsers)
    add_prepare_parser(subparsers)
    add_plan_parser(subparsers, STRATEGY_NAMES)
    add_launch_parser(subparsers)
    add_export_parser(subparsers)
    add_generate_parser(subparsers)
    return parser, subparsers


def _run(args: argparse.Namespace, command: argparse.ArgumentParser) -> int:
    """The command ``args`` names; the errors a user can cause end it with their code and one line."""
    try:
        return {"train": train, "prepare": prepare_command, "plan": plan_command,
                "launch": launch_command, "export": export_command,
                "generate": generate_command}[args.command](args)
    except UsageError as error:  # anything else is a bug and keeps its traceback (exit code 1)
        # the library names its parameters; here they are this command's flags
        print(f"shardax {args.command}: error: {in_flags(str(error), command)}", file=sys.stderr)
        if "checkpoint" in str(error) and "shardax.trainer.checkpoint" in sys.modules:
            from shardax.cli.errors import silence_abandoned_writers

            silence_abandoned_writers()  # a failed checkpoint write is said once, above
        return EXIT_BAD_INPUT
    except NonFiniteError as error:
        print(f"shardax {args.command}: error: {error}", file=sys.stderr)
        return EXIT_NONFINITE
    except ClusterError as error:
        print(f"shardax {args.command}: error: {error}", file=sys.stderr)
        return EXIT_CLUSTER
    except Preempted:  # the Trainer printed where the checkpoint is
        return EXIT_PREEMPTED


if __name__ == "__main__":
    sys.exit(main())

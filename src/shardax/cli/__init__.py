"""The ``shardax`` command: ``train`` (the LM job), ``prepare`` (token shards), ``plan`` (what fits,
what it costs), ``launch``, ``export`` (a checkpoint as Hugging Face's), ``generate`` (text).

Each subcommand lives in its own module; this one parses and reports errors: bad input is one
line on stderr and exit code 2, with no traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from shardax.cli.errors import (EXIT_BAD_INPUT, EXIT_CLUSTER, EXIT_NONFINITE, EXIT_PREEMPTED, ClusterError,
                                NonFiniteError, Preempted, UsageError, in_flags)
from shardax.cli.export import add_export_parser, export_command
from shardax.cli.generate import add_generate_parser, generate_command
from shardax.cli.launch import add_launch_parser, launch_command
from shardax.cli.plan import add_plan_parser, plan_command
from shardax.cli.prepare import add_prepare_parser, prepare_command
from shardax.cli.train import STRATEGY_NAMES, add_train_parser, train


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line like every other bad input (usage stays in --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="shardax", description="Train Flax NNX models across devices and hosts.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_train_parser(subparsers)
    add_prepare_parser(subparsers)
    add_plan_parser(subparsers, STRATEGY_NAMES)
    add_launch_parser(subparsers)
    add_export_parser(subparsers)
    add_generate_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return {"train": train, "prepare": prepare_command, "plan": plan_command,
                "launch": launch_command, "export": export_command, "generate": generate_command}[args.command](args)
    except UsageError as error:  # anything else is a bug and keeps its traceback (exit code 1)
        # the library names its parameters; here they are this command's flags
        print(f"shardax {args.command}: error: {in_flags(str(error), subparsers.choices[args.command])}",
              file=sys.stderr)
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
    except KeyboardInterrupt:
        print(f"shardax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

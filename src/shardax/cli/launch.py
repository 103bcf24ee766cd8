"""``shardax launch -n N -- COMMAND``: N processes of one JAX cluster on this machine."""

from __future__ import annotations

import argparse
from typing import Any


def add_launch_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch", help="run a command as N processes of one JAX cluster on this machine",
        description="Start N processes wired together through a coordinator on 127.0.0.1, e.g. "
                    "shardax launch -n 2 -- shardax train --strategy fsdp")
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="how many processes")
    parser.add_argument("--devices-per-process", type=int, help="simulated CPU devices each (default 8 // n)")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command to run")
    return parser


def launch_command(args: argparse.Namespace) -> int:
    from shardax.launch import launch

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    devices = args.devices_per_process
    if devices is None:
        devices = max(1, 8 // max(args.num_processes, 1))
    return launch(command, args.num_processes, devices)



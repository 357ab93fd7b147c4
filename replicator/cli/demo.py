"""`replicator demo`: its options, and the demo run they describe."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `replicator demo` with its options; the parsed options run `run`."""
    parser = commands.add_parser("demo", help="train a small ResNet on digits with 2 replicas and report scaling")
    parser.add_argument("-n", "--replicas", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=12)
    parser.set_defaults(run=run)


def run(options: argparse.Namespace) -> int:
    """Time one replica, train on N, print the table; 0 when the accuracy target is reached."""
    from replicator.demo.driver import run_demo

    return run_demo(replicas=options.replicas, epochs=options.epochs)

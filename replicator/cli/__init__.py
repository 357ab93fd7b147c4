"""The `replicator` command: launch | demo | plan | report, one module per subcommand."""

from __future__ import annotations

import argparse
import sys

from replicator.cli import demo, launch, plan, report

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

# Each module registers its subcommand with `add_parser(commands)` and sets the parsed
# options' `run`: a new subcommand (`report`) is one more module in this list.
SUBCOMMANDS = (launch, demo, plan, report)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand in SUBCOMMANDS."""
    parser = argparse.ArgumentParser(prog="replicator",
                                     description="The `replicator` command: launch | demo | plan | report.")
    commands = parser.add_subparsers(dest="command", required=True)
    for subcommand in SUBCOMMANDS:
        subcommand.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the command line) and run the subcommand; returns its exit code."""
    options = build_parser().parse_args(argv)
    return int(options.run(options))


if __name__ == "__main__":
    sys.exit(main())

"""`replicator launch`: its options, and the launch they describe."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `replicator launch` with its options; the parsed options run `run`."""
    parser = commands.add_parser("launch", help="run a training script on N replicas per node")
    parser.add_argument("-n", "--nproc-per-node", type=int, default=1, help="replicas on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index, 0 on the master")
    parser.add_argument("--master", default=None, help="HOST:PORT of node 0 (multi-node); default: this machine")
    parser.add_argument("--threads", type=int, default=None, help="threads per process (default: cores / replicas)")
    parser.add_argument("-m", "--module", action="store_true", help="target is a module, as in python -m")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="when a process dies, restart the whole job up to R times "
                             "(it resumes from its last checkpoint)")
    parser.add_argument("--master-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="how long a node other than node 0 waits for node 0 to listen (default 300)")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="where failed replicas' tracebacks and torchrun's messages are kept "
                             "(default: a temporary directory, removed when the job succeeds)")
    parser.add_argument("target", help="script.py (or a module with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(run=run)


def run(options: argparse.Namespace) -> int:
    """Launch the job; 2 with a one-line reason when the options do not describe one, 1 when node 0 never
    answered."""
    from replicator.launch import LaunchSpec, launch

    spec = LaunchSpec(
        target=options.target, args=options.args, nproc_per_node=options.nproc_per_node,
        nnodes=options.nnodes, node_rank=options.node_rank, master=options.master,
        module=options.module, threads_per_process=options.threads, max_restarts=options.max_restarts,
        master_timeout_s=options.master_timeout, log_dir=options.log_dir,
    )
    try:
        return launch(spec)
    except (ValueError, FileNotFoundError) as error:
        print(f"replicator launch: {error}", file=sys.stderr)
        return 2
    except TimeoutError as error:
        print(f"replicator launch: {error}", file=sys.stderr)
        return 1

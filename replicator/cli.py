"""The `replicator` command: launch | demo | plan."""

from __future__ import annotations

import argparse
import sys

from replicator.launch import LaunchSpec, launch

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replicator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("launch", help="run a training script on N replicas per node")
    run.add_argument("-n", "--nproc-per-node", type=int, default=1, help="replicas on this node")
    run.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    run.add_argument("--node-rank", type=int, default=0, help="this node's index, 0 on the master")
    run.add_argument("--master", default=None, help="HOST:PORT of node 0 (multi-node); default: this machine")
    run.add_argument("--threads", type=int, default=None, help="threads per process (default: cores / replicas)")
    run.add_argument("-m", "--module", action="store_true", help="target is a module, as in python -m")
    run.add_argument("--max-restarts", type=int, default=0, metavar="R",
                     help="when a process dies, restart the whole job up to R times (it resumes from its last checkpoint)")
    run.add_argument("target", help="script.py (or a module with -m)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    demo = commands.add_parser("demo", help="train a small ResNet on digits with 2 replicas and report scaling")
    demo.add_argument("-n", "--replicas", type=int, default=2)
    demo.add_argument("--epochs", type=int, default=12)

    from replicator.plan.cli import add_arguments as add_plan_arguments

    plan = commands.add_parser("plan", help="predict scaling (alpha-beta model); recommend a reducer, bucket, pipeline")
    add_plan_arguments(plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    if options.command == "launch":
        spec = LaunchSpec(
            target=options.target, args=options.args, nproc_per_node=options.nproc_per_node,
            nnodes=options.nnodes, node_rank=options.node_rank, master=options.master,
            module=options.module, threads_per_process=options.threads, max_restarts=options.max_restarts,
        )
        try:
            return launch(spec)
        except (ValueError, FileNotFoundError) as error:
            print(f"replicator launch: {error}", file=sys.stderr)
            return 2
    if options.command == "demo":
        from replicator.demo.driver import run_demo

        return run_demo(replicas=options.replicas, epochs=options.epochs)
    if options.command == "plan":
        from replicator.plan.cli import main as plan_main

        return plan_main(options)
    return 2


if __name__ == "__main__":
    sys.exit(main())

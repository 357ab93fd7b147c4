"""Latency of the small control messages replicator exchanges: Gloo against a LocalLink.

Command (from the repository root; about half a minute on 2 cores; figures go to
benchmarks/results/control_latency.json):

    .venv/bin/python benchmarks/control_latency.py

Every step of `repl.run` makes a few tiny exchanges: the announcement of the next step, the
gradient sync's agreement check, the shared-memory sum's barrier, a `ctx` collective's check.
Each is a few dozen bytes, so its cost is all latency. This times, in 2 processes on one
node, a Gloo barrier, a Gloo all-gather of a 5-integer agreement row and a Gloo all-reduce of
a scalar loss (torch's own collectives, the peer) against a LocalLink barrier, a LocalLink
agreement row (`replicator/comm/local_link.py`) and `all_sum` of the loss over a group with a
link attached (as `ctx.all_mean(loss)` goes on one node), interleaved in rounds. Each exchange
is timed both back to back and after ~1 ms of matrix products, as it comes in a training step,
where the two processes arrive at slightly different times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _harness import add_json_argument, in_turns, machine, machine_line, write_json

from replicator.comm import collectives
from replicator.comm.local_link import LocalLink
from replicator.testing import run_replicas
from replicator.topology import build_process_groups, discover


def _measure(rounds: int, per_round: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    group = build_process_groups(discover()).control
    link = LocalLink.connect(group, timeout_s=60)
    if link is None:
        raise RuntimeError("no LocalLink could be made between the two processes")
    data_link = LocalLink.connect(group, timeout_s=60)
    assert data_link is not None
    collectives.attach_link(group, data_link)  # what rp.Replicator does for its replica group
    row = torch.zeros(5, dtype=torch.int64)
    loss = torch.tensor(1.5)
    rows = [torch.empty_like(row) for _ in range(2)]
    matrix = torch.randn(160, 160)

    def compute() -> None:
        for _ in range(8):
            matrix @ matrix

    contenders: dict[str, Callable[[], None]] = {
        "gloo barrier": lambda: dist.barrier(group=group),
        "gloo all_gather (agreement row)": lambda: dist.all_gather(rows, row, group=group),
        "LocalLink barrier": link.barrier,
        "LocalLink agreement row": lambda: link.collect(link.post(row.numpy().tobytes())),
        "gloo all_reduce (a loss)": lambda: dist.all_reduce(loss.clone(), group=group),
        "LocalLink all_sum (a loss)": lambda: collectives.all_sum(loss, group),
    }
    samples: dict[str, list[float]] = {
        f"{name}{suffix}": [] for name in contenders for suffix in ("", " after compute")
    }
    # The same order in every round: each kind of exchange follows the same neighbour each time.
    for _, name in in_turns(list(contenders), rounds, rotate=False):
        exchange = contenders[name]
        for after_compute in (False, True):
            for _ in range(per_round):
                if after_compute:
                    compute()
                started = time.perf_counter()
                exchange()
                samples[f"{name}{' after compute' if after_compute else ''}"].append(time.perf_counter() - started)
    link.close()
    collectives.detach_link(group)
    data_link.close()
    return {name: {"median_us": 1e6 * statistics.median(times),
                   "p90_us": 1e6 * sorted(times)[int(0.9 * len(times))]} for name, times in samples.items()}


_PEERS = {"LocalLink barrier": "gloo barrier", "LocalLink agreement row": "gloo all_gather (agreement row)",
          "LocalLink all_sum (a loss)": "gloo all_reduce (a loss)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds over the contenders")
    parser.add_argument("--per-round", type=int, default=50, help="exchanges timed per contender per round")
    add_json_argument(parser, "control_latency")
    args = parser.parse_args()
    header = machine()
    figures = run_replicas(_measure, 2, args.rounds, args.per_round, timeout_s=600)[0]
    print(machine_line(header))
    print(f"2 processes on one node; {args.rounds} rounds x {args.per_round} exchanges each (rank 0)\n")
    print("| exchange | median µs | p90 µs | median vs the Gloo peer |")
    print("| --- | ---: | ---: | ---: |")
    for name, figure in figures.items():
        peer = name
        for ours, theirs in _PEERS.items():
            peer = peer.replace(ours, theirs)
        ratio = "(peer)" if peer == name else f"{figures[peer]['median_us'] / figure['median_us']:.1f}x faster"
        print(f"| {name} | {figure['median_us']:.1f} | {figure['p90_us']:.1f} | {ratio} |")
    write_json(args.json, {"rounds": args.rounds, "per_round": args.per_round, "figures": figures}, header)


if __name__ == "__main__":
    main()

"""Round trips over the peer link against one Gloo send/recv each way and a torch.distributed.rpc echo.

Command (from the repository root; about a minute on 2 loaded cores; figures go to
benchmarks/results/peer_link.json):

    .venv/bin/python benchmarks/peer_link.py

Two processes on one node. Rank 1 sends a float32 tensor to rank 0 and waits for it to come
back, for a 4 KB tensor and for an 85k-parameter model's worth (340 KB), through:

- *peer link (unix)* and *peer link (tcp)*: `replicator/comm/peer_link.py`, rank 0 serving
  with `PeerServer.receive()` (its any-source event loop) and echoing the frame it got;
  rank 1 receiving into its own tensor;
- *gloo send/recv*: `dist.send` then `dist.recv` on rank 1, the mirror on rank 0 (it must
  name its source: the very thing the peer link's server does not need);
- *rpc_sync echo*: `torch.distributed.rpc.rpc_sync` of a function that returns its argument
  (TensorPipe, the RPC pattern of PyTorch's parameter-server tutorial).

The contenders take turns in phases (the order rotates every repetition); a phase's figure
is the median round trip of its round trips, a contender's the median over repetitions, and
the ratios are paired within a repetition. CPU time is `time.process_time()` of both
processes (all their threads: Gloo's and TensorPipe's too) over their part of the phase,
with no barrier inside it, per round trip; for the RPC arm rank 0's part lasts until rank 1
says it is done (one frame, waited for in epoll). Both processes host an RPC agent and
Gloo's threads throughout, whose background CPU lands on every arm; the last column is the
peer link's own cost, the CPU of the two main threads (where all of its work happens).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _harness import add_json_argument, compare, in_turns, machine, machine_line, ratio_text, write_json

from replicator.comm.frames import FIRST_USER_KIND
from replicator.comm.peer_link import connect
from replicator.comm.peer_server import PeerServer
from replicator.testing import run_replicas
from replicator.testing.processes import free_port

SIZES = {"4 KB": 1024, "85k params (340 KB)": 85_000}
ARMS = ("peer link (unix)", "peer link (tcp)", "gloo send/recv", "rpc_sync echo")
ECHO, DONE = FIRST_USER_KIND, FIRST_USER_KIND + 1


def echo(tensor: torch.Tensor) -> torch.Tensor:
    """The RPC arm's remote function."""
    return tensor


def _measure(rpc_port: int, repeats: int, per_phase: int) -> dict[str, Any]:
    from torch.distributed import rpc

    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{rpc_port}", rpc_timeout=120))
    servers = {}
    if rank == 0:
        servers = {"unix": PeerServer("bench-unix", rank=0, role="server"),
                   "tcp": PeerServer("bench-tcp", rank=0, role="server", host="127.0.0.1")}
    dist.barrier()
    links = {}
    if rank == 1:
        links = {"unix": connect("bench-unix", rank=1, role="client"),
                 "tcp": connect("bench-tcp", rank=1, role="client", force_tcp=True)}
    for server in servers.values():  # a peer's connect returns once the server's loop has answered it
        server.wait_for(1)
    tensors = {size: torch.randn(numel) for size, numel in SIZES.items()}

    def serve(server: PeerServer) -> None:
        for _ in range(per_phase):
            received = server.receive()
            assert received is not None
            peer, frame = received
            server.send(peer, frame.kind, frame.tensors)

    def client_arm(arm: str, tensor: torch.Tensor) -> Callable[[], None]:
        def over_link() -> None:
            link = links[arm.split("(")[1].rstrip(")")]
            link.send(ECHO, [tensor])
            link.receive(into=[tensor])

        def over_gloo() -> None:
            dist.send(tensor, dst=0)
            dist.recv(tensor, src=0)

        def over_rpc() -> None:
            rpc.rpc_sync("worker0", echo, args=(tensor,))

        return over_link if arm.startswith("peer link") else over_gloo if arm == "gloo send/recv" else over_rpc

    walls: dict[str, dict[str, list[float]]] = {size: {arm: [] for arm in ARMS} for size in SIZES}
    cpus: dict[str, dict[str, list[float]]] = {size: {arm: [] for arm in ARMS} for size in SIZES}
    threads: dict[str, dict[str, list[float]]] = {size: {arm: [] for arm in ARMS} for size in SIZES}
    for size, tensor in tensors.items():
        for _, arm in in_turns(ARMS, repeats + 1):  # the first repetition warms up, and is dropped below
            dist.barrier()
            cpu = time.process_time()  # from here to the end of this rank's part of the phase, no barrier inside
            own = time.thread_time()
            times = []
            if rank == 1:
                trip = client_arm(arm, tensor)
                for _ in range(per_phase):
                    started = time.perf_counter()
                    trip()
                    times.append(time.perf_counter() - started)
                spent, spent_own = time.process_time() - cpu, time.thread_time() - own
                if arm == "rpc_sync echo":
                    links["unix"].send(DONE)  # rank 0 waits for it in epoll, at no CPU cost
            elif arm.startswith("peer link"):
                serve(servers[arm.split("(")[1].rstrip(")")])
            elif arm == "gloo send/recv":
                for _ in range(per_phase):
                    dist.recv(tensor, src=1)
                    dist.send(tensor, dst=1)
            else:  # the RPC arm: TensorPipe's threads serve on rank 0 until rank 1 says it is done
                received = servers["unix"].receive()
                assert received is not None and received[1].kind == DONE
            if rank == 0:
                spent, spent_own = time.process_time() - cpu, time.thread_time() - own
            total = torch.tensor([spent, spent_own], dtype=torch.float64)
            dist.all_reduce(total)
            if rank == 1:
                walls[size][arm].append(statistics.median(times))
                cpus[size][arm].append(float(total[0]) / per_phase)
                threads[size][arm].append(float(total[1]) / per_phase)
    for link in links.values():
        link.close()
    for server in servers.values():
        server.close()
    rpc.shutdown()
    # Drop each arm's first phase: the warm-up.
    return {"walls": {s: {a: v[1:] for a, v in arms.items()} for s, arms in walls.items()},
            "cpus": {s: {a: v[1:] for a, v in arms.items()} for s, arms in cpus.items()},
            "threads": {s: {a: v[1:] for a, v in arms.items()} for s, arms in threads.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="repetitions, each a phase of every contender")
    parser.add_argument("--per-phase", type=int, default=100, help="round trips timed per phase")
    add_json_argument(parser, "peer_link")
    args = parser.parse_args()
    header = machine()
    figures = run_replicas(_measure, 2, free_port(), args.repeats, args.per_phase, timeout_s=900)[1]
    header["load_average_after"] = machine()["load_average"]
    print(machine_line(header))
    print(f"2 processes on one node; {args.repeats} repetitions x {args.per_phase} round trips per contender\n")
    report: dict[str, Any] = {"repeats": args.repeats, "per_phase": args.per_phase, "sizes": {}}
    for size in SIZES:
        walls, cpus, threads = figures["walls"][size], figures["cpus"][size], figures["threads"][size]
        versus_rpc = compare(walls, "rpc_sync echo")
        versus_gloo = compare(walls, "gloo send/recv")
        cpu_versus_rpc = compare(cpus, "rpc_sync echo")
        print(f"{size}:")
        print("| contender | round trip µs, median (min–max) | paired vs rpc_sync | paired vs gloo | "
              "CPU µs per round trip, both processes | CPU paired vs rpc_sync | the link's own CPU µs |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for arm in ARMS:
            wall, cpu = versus_rpc[arm].spread, cpu_versus_rpc[arm].spread
            print(f"| {arm} | {1e6 * wall.median:.0f} ({1e6 * wall.min:.0f}–{1e6 * wall.max:.0f}) | "
                  f"{ratio_text(versus_rpc[arm].paired)} | {ratio_text(versus_gloo[arm].paired)} | "
                  f"{1e6 * cpu.median:.0f} | {ratio_text(cpu_versus_rpc[arm].paired)} | "
                  f"{f'{1e6 * statistics.median(threads[arm]):.0f}' if arm.startswith('peer link') else '—'} |")
        print()
        report["sizes"][size] = {arm: {"round_trip_us": 1e6 * versus_rpc[arm].spread.median,
                                       "paired_vs_rpc": versus_rpc[arm].paired,
                                       "paired_vs_gloo": versus_gloo[arm].paired,
                                       "cpu_us_per_round_trip": 1e6 * cpu_versus_rpc[arm].spread.median,
                                       "cpu_paired_vs_rpc": cpu_versus_rpc[arm].paired,
                                       "round_trip_s": walls[arm], "cpu_s": cpus[arm],
                                       "main_thread_cpu_s": threads[arm]} for arm in ARMS}
    write_json(args.json, report, header)


if __name__ == "__main__":
    main()

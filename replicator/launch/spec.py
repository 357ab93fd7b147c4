"""What `replicator launch` starts and where: the script, replicas per node, nodes, master, restarts."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["LaunchSpec"]


@dataclass
class LaunchSpec:
    """What to start and where. `master` is HOST:PORT of node 0; None means this machine only."""

    target: str
    args: list[str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master: str | None = None
    module: bool = False
    threads_per_process: int | None = None
    max_restarts: int = 0  # whole-job restarts after a failure; the job resumes from its checkpoint
    master_timeout_s: float = 300.0  # how long a node other than 0 waits for node 0 to listen
    log_dir: str | None = None  # where the launch log and torchrun's error files go; None: a temporary directory

    def validate(self) -> None:
        """Raise ValueError (or FileNotFoundError for a missing script) naming the option to fix."""
        if self.nproc_per_node < 1:
            raise ValueError(f"-n must be at least 1, got {self.nproc_per_node}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.master:
            raise ValueError("a multi-node launch needs --master HOST:PORT (the address of node 0, same on every node)")
        if self.master and (":" not in self.master or not self.master.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"--master must look like HOST:PORT, got {self.master!r}")
        if not self.master_timeout_s > 0:
            raise ValueError(f"--master-timeout must be a positive number of seconds, got {self.master_timeout_s}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not self.module and not os.path.exists(self.target):
            raise FileNotFoundError(f"no such script: {self.target}")

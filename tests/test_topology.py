"""Topology discovery from torchrun's and Slurm's environments, and the launcher's arguments."""

from __future__ import annotations

import pytest
import torch

from replicator.errors import ReplicatorUsageError
from replicator.launch import LaunchSpec, torchrun_arguments
from replicator.topology import Topology, discover


def test_plain_python_is_one_replica_on_cpu() -> None:
    topology = discover({})
    assert (topology.rank, topology.world_size, topology.launcher) == (0, 1, "none")
    assert not topology.distributed
    assert topology.backend == "gloo" and topology.device.type == "cpu"


def test_torchrun_environment() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234"}
    topology = discover(env)
    assert topology == Topology(5, 8, 1, 4, 1, 2, "10.1.2.3", 1234, "torchrun")


def test_slurm_environment() -> None:
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    topology = discover(env)
    assert (topology.rank, topology.world_size, topology.local_rank, topology.local_world_size) == (6, 8, 2, 4)
    assert (topology.node_rank, topology.num_nodes, topology.master_addr) == (1, 2, "gpu07")
    assert topology.launcher == "slurm"


def test_bad_environment_is_named() -> None:
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        discover({"RANK": "0", "WORLD_SIZE": "two"})


def test_single_node_launch_binds_loopback() -> None:
    arguments = torchrun_arguments(LaunchSpec("train.py", ["--lr", "1"], nproc_per_node=4))
    # replicator's own rendezvous: torchrun's static one would start a store on every interface
    assert arguments[arguments.index("--rdzv-backend") + 1] == "replicator-loopback"
    assert arguments[arguments.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")
    assert "--master-addr" not in arguments
    assert arguments[-3:] == ["train.py", "--lr", "1"]


def test_multi_node_launch_needs_a_master() -> None:
    with pytest.raises(ValueError, match="--master HOST:PORT"):
        LaunchSpec("train.py", [], nproc_per_node=2, nnodes=2, node_rank=1).validate()
    arguments = torchrun_arguments(LaunchSpec("train.py", [], 8, nnodes=2, node_rank=1, master="node0:29400"))
    assert arguments[arguments.index("--master-addr") + 1] == "node0"
    assert arguments[arguments.index("--node-rank") + 1] == "1"


def test_replicas_that_would_share_a_gpu_in_an_nccl_group_are_refused_before_nccl_sees_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU machine cannot start NCCL; what is checked is the arithmetic that runs before it would.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("REPLICATOR_DEVICE", raising=False)
    monkeypatch.delenv("REPLICATOR_BACKEND", raising=False)
    two_on_one_node = Topology(rank=1, world_size=2, local_rank=1, local_world_size=2, launcher="torchrun")
    assert two_on_one_node.backend == "nccl"
    with pytest.raises(ReplicatorUsageError, match=r"2 processes of this node share an NCCL group but 1 GPU"):
        two_on_one_node.refuse_shared_gpus([[0, 1]])
    two_on_one_node.refuse_shared_gpus([[0], [1]])  # actor-learner roles of one process each: fine
    two_nodes = Topology(rank=1, world_size=2, local_rank=0, local_world_size=1, node_rank=1, num_nodes=2,
                         launcher="torchrun")
    two_nodes.refuse_shared_gpus([[0, 1]])  # one process per node: one GPU each
    monkeypatch.setenv("REPLICATOR_BACKEND", "gloo")
    two_on_one_node.refuse_shared_gpus([[0, 1]])  # Gloo lets CUDA replicas share a GPU


def test_replicator_device_and_backend_variables_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    topology = Topology(rank=0, world_size=2, local_rank=0, local_world_size=2, launcher="torchrun")
    monkeypatch.setenv("REPLICATOR_DEVICE", "gpu")
    with pytest.raises(ValueError, match="REPLICATOR_DEVICE='gpu' is not one of cpu, cuda"):
        _ = topology.device
    monkeypatch.setenv("REPLICATOR_DEVICE", "cpu")
    assert topology.device == torch.device("cpu") and topology.backend == "gloo"
    monkeypatch.setenv("REPLICATOR_BACKEND", "nccl")
    with pytest.raises(ReplicatorUsageError, match="REPLICATOR_BACKEND=nccl needs CUDA replicas"):
        _ = topology.backend
    if not torch.cuda.is_available():
        monkeypatch.setenv("REPLICATOR_DEVICE", "cuda")
        with pytest.raises(ReplicatorUsageError, match="REPLICATOR_DEVICE=cuda, but torch .* sees no CUDA GPU"):
            _ = topology.device

"""Each pipeline stage's own random stream: distinct per stage and replica, reproducible from the user's seed."""

from __future__ import annotations

import hashlib

import torch

from replicator.topology import Mesh

__all__ = ["seed_stage"]


def seed_stage(mesh: Mesh) -> int | None:
    """Reseed this process's torch generators (CPU and accelerators) for its stage and replica; return the seed.

    Called by the Replicator once a pipeline is built: when its scope ends, or at once outside
    one. A job of one process keeps its stream (it draws as the unsplit model would): None.

    Every process seeds alike and builds the whole model, so every generator ends the build
    in the same state: stage 1's dropout would draw stage 0's masks (and replica 1 replica
    0's), correlating layers that single-process training draws independently. The new seed
    is drawn from that shared state and mixed with (stage, replica): the same seed gives the
    same run, and no two stages or replicas share a stream. Re-materialization still
    replays the forward's masks (torch.utils.checkpoint restores the generator state).
    """
    if mesh.world_size == 1:
        return None
    base = int(torch.randint(0, 2**62, (1,)).item())
    digest = hashlib.blake2b(f"{base}/{mesh.stage_id}/{mesh.replica_id}".encode(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little") >> 1  # torch takes seeds below 2**64; keep clear of the sign bit
    torch.manual_seed(seed)
    return seed

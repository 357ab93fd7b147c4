"""What share of a link's line rate an all-reduce achieves, per kind of transport, with its source."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Transport", "TRANSPORTS", "transport"]


@dataclass(frozen=True)
class Transport:
    """A kind of link and the fraction of its line rate (one direction) a large all-reduce moves over it."""

    name: str
    efficiency: float
    source: str


# Large-message all-reduce bus bandwidth (NCCL tests' busbw, which is comparable to the link's rate
# whatever the number of ranks) over the line rate. Published measurements, not fitted here.
TRANSPORTS: dict[str, Transport] = {
    "nvlink": Transport(
        "nvlink", 0.77,
        "NCCL maintainer, NVIDIA/nccl-tests issue 149 (2023): about 230 GB/s all-reduce busbw on A100 NVLink3 "
        "(300 GB/s per direction); 0.82 on H100 NVLink4 ring (issue 212)"),
    "pcie": Transport(
        "pcie", 0.77,
        "assumption: the NVLink share (no published PCIe all-reduce figure was found); NCCL moves the same "
        "128-byte-protocol packets over both"),
    "infiniband": Transport(
        "infiniband", 0.96,
        "NCCL maintainer, NVIDIA/nccl-tests issue 119 (2022): 24 GB/s peak per 200 Gb/s NIC, 12 GB/s per 100 Gb/s; "
        "NVIDIA/nccl issue 812: 192 of 200 GB/s on a DGX A100's 8 HDR ports"),
    "roce": Transport(
        "roce", 0.96,
        "as InfiniBand: the same NICs and GPUDirect RDMA path (NVIDIA/nccl-tests issue 119)"),
    "tcp": Transport(
        "tcp", 0.54,
        "NVIDIA/nccl-tests issue 83 (2021): 13.6 of 25 Gb/s all-reduce busbw over TCP with several GPUs per node; "
        "NVIDIA/nccl issue 209 measured 0.46-0.70 with 8 GPUs per node at 32 Gb/s (0.96 with one)"),
}


def transport(name: str) -> Transport:
    """The transport called `name` (case-insensitive); ValueError naming the known ones otherwise."""
    try:
        return TRANSPORTS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}") from None

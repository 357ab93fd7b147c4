"""Named models with their per-layer gradient profiles, hardware figures with sources, and the global assumptions."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from replicator.plan.profile import GradientProfile

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ModelPreset",
    "MODELS",
    "Hardware",
    "P100_SXM2_FP32",
    "P100_PCIE_FP32",
    "P100_SXM2_MEMORY",
    "NVLINK1_GPU_PAIR",
    "NVLINK1_DGX1",
    "NVLINK2_V100",
    "NVLINK3_A100",
    "PCIE3_X16",
    "INFINIBAND_EDR",
    "ROCE_25G",
    "ETHERNET_50G",
    "ETHERNET_100G",
    "DGX2H_NETWORK",
    "COMPUTE_EFFICIENCY",
    "INTRA_NODE_LATENCY",
    "NETWORK_LATENCY",
    "FUSION_BUCKET",
    "INTERFERENCE",
]


def _networks() -> Callable[[str], nn.Module]:
    from replicator.plan import networks

    builders: dict[str, Callable[[], nn.Module]] = {
        "resnet50": lambda: networks.resnet((3, 4, 6, 3)),
        "resnet101": lambda: networks.resnet((3, 4, 23, 3)),
        "resnet152": lambda: networks.resnet((3, 8, 36, 3)),
        "vgg16": networks.vgg16,
        "inception_v3": networks.inception_v3,
        "bert_large": networks.bert,
        "gpt2_1.2b": lambda: networks.gpt(40, 1536, 16),
    }
    return lambda name: builders[name]()


@dataclass(frozen=True)
class ModelPreset:
    """A well-known network: parameter count and forward FLOPs per sample (2 per multiply-add) as published,
    the input one sample has, and its per-layer profile read from our torch definition (planner.networks)."""

    name: str
    params: int
    forward_flops: float
    source: str
    input_shape: tuple[int, ...]
    input_dtype: str = "float32"

    def profile(self) -> GradientProfile:
        """The gradient per layer in backward order, with FLOPs counted on the meta device (cached)."""
        return _profile(self.name, self.input_shape, self.input_dtype)


@functools.cache
def _profile(name: str, shape: tuple[int, ...], dtype: str) -> GradientProfile:
    import torch

    from replicator.plan.profile import from_module

    with torch.device("meta"):
        module = _networks()(name)
    return from_module(module, torch.zeros((1, *shape), dtype=getattr(torch, dtype), device="meta"))


# torchvision's model tables list multiply-adds ("GFLOPS" there = GMAC); a FLOP/s peak
# counts a fused multiply-add as 2, so forward FLOPs = 2 × GMAC. tests/plan checks that each
# profile's parameter count and counted FLOPs agree with these.
MODELS: dict[str, ModelPreset] = {
    "resnet50": ModelPreset("resnet50", 25_557_032, 2 * 4.09e9,
                            "torchvision model table: 25,557,032 params, 4.09 GMAC at 224×224 "
                            "(He et al. 2016: 3.8 GMAC)", (3, 224, 224)),
    "resnet101": ModelPreset("resnet101", 44_549_160, 2 * 7.80e9,
                             "torchvision model table: 44,549,160 params, 7.80 GMAC at 224×224 "
                             "(He et al. 2016: 7.6 GMAC)", (3, 224, 224)),
    "resnet152": ModelPreset("resnet152", 60_192_808, 2 * 11.51e9,
                             "torchvision model table: 60,192,808 params, 11.51 GMAC at 224×224", (3, 224, 224)),
    "inception_v3": ModelPreset("inception_v3", 23_834_568, 2 * 5.71e9,
                                "torchvision model table: 27,161,264 params with the auxiliary head "
                                "(3,326,696 of them), 5.71 GMAC at 299×299", (3, 299, 299)),
    "vgg16": ModelPreset("vgg16", 138_357_544, 2 * 15.47e9,
                         "torchvision model table: 138,357,544 params, 15.47 GMAC at 224×224", (3, 224, 224)),
    "bert_large": ModelPreset("bert_large", 335_141_888, 2 * 39.46e9,
                              "Devlin et al. 2019: 24 layers, 1024 wide, 16 heads (\"340M\"); counted from the "
                              "architecture with its pooler, 128 tokens", (128,), "long"),
    "gpt2_1.2b": ModelPreset("gpt2_1.2b", 1_213_479_936, 2 * 1.369e12,
                             "Shoeybi et al. 2019 (Megatron-LM) Table 1: 1.2B parameters, 40 layers, hidden 1536, "
                             "16 heads, 1024 tokens, vocabulary padded to 51,200; counted from the architecture",
                             (1024,), "long"),
}


@dataclass(frozen=True)
class Hardware:
    """A figure from a vendor specification or a publication, in SI units (FLOP/s, bytes/s, samples/s)."""

    value: float
    source: str


P100_SXM2_FP32 = Hardware(10.6e12, "NVIDIA Tesla P100 datasheet: 10.6 TFLOP/s fp32 (NVLink/SXM2 module)")
P100_PCIE_FP32 = Hardware(9.3e12, "NVIDIA Tesla P100 datasheet: 9.3 TFLOP/s fp32 (PCIe card)")
P100_SXM2_MEMORY = Hardware(732e9, "NVIDIA Tesla P100 datasheet: 732 GB/s HBM2 memory bandwidth (NVLink/SXM2 module)")
NVLINK1_GPU_PAIR = Hardware(40e9, "NVLink 1.0: 20 GB/s per direction per link, 2 links between paired P100s "
                                  "(IBM Redbook REDP-5405, S822LC for HPC)")
NVLINK1_DGX1 = Hardware(80e9, "NVLink 1.0 in a DGX-1 (P100): 4 links of 20 GB/s per direction per GPU "
                              "(NVIDIA P100 whitepaper)")
NVLINK2_V100 = Hardware(150e9, "NVLink 2.0 (V100): 6 links of 25 GB/s per direction per GPU; a DGX-2's NVSwitch "
                               "gives each GPU the same 150 GB/s (\"300 GB/s\" counts both directions)")
NVLINK3_A100 = Hardware(300e9, "NVLink 3.0 (A100): 12 links of 25 GB/s per direction per GPU, through NVSwitch")
PCIE3_X16 = Hardware(15.75e9, "PCIe 3.0 x16: 8 GT/s × 16 lanes × 128/130 = 15.75 GB/s per direction")
INFINIBAND_EDR = Hardware(100e9 / 8, "InfiniBand EDR: 100 Gbit/s = 12.5 GB/s per direction")
ROCE_25G = Hardware(25e9 / 8, "25 Gbit/s Ethernet (RoCE): 3.125 GB/s per direction")
ETHERNET_50G = Hardware(50e9 / 8, "50 Gbit/s Ethernet: 6.25 GB/s per direction")
ETHERNET_100G = Hardware(100e9 / 8, "100 Gbit/s Ethernet: 12.5 GB/s per direction")
DGX2H_NETWORK = Hardware(100e9, "Shoeybi et al. 2019, §5: \"100 GB/sec ... between servers using 8 InfiniBand "
                                "adapters per server\"")

# Global assumptions: one value for every case, not tuned per case (docs/concepts/scaling.md).
# Achieved / peak FLOP/s when no measured throughput is given (CLI default; every published case
# brings a measured one).
COMPUTE_EFFICIENCY = 0.5
# Seconds per message step inside a node and across the network, software included.
INTRA_NODE_LATENCY = 5e-6
NETWORK_LATENCY = 10e-6
# Gradient message size: Horovod's documented default fusion buffer (64 MB, until v0.21).
FUSION_BUCKET = 64 * 1024 * 1024
# The share of overlapped all-reduce time that still lengthens the step (κ; `--overlap` is 1 − κ): the one
# constant fitted to the published rows (published.fit_interference; tests/plan/test_published.py refits it
# and fails if this differs). `replicator plan` and `replicator plan --reproduce` both use it.
INTERFERENCE = 0.4775

"""Named models, hardware figures, global assumptions and the published scaling results we reproduce."""

from __future__ import annotations

from dataclasses import dataclass, replace

from replicator.plan.planner import MB, Cluster, Prediction, ReduceAlgorithm, predict
from replicator.plan.step import Accelerator, Workload

__all__ = [
    "ModelPreset",
    "MODELS",
    "Hardware",
    "P100_SXM2_FP32",
    "P100_PCIE_FP32",
    "NVLINK1_GPU_PAIR",
    "PCIE3_X16",
    "INFINIBAND_EDR",
    "ROCE_25G",
    "COMPUTE_EFFICIENCY",
    "INTRA_NODE_LATENCY",
    "NETWORK_LATENCY",
    "FUSION_BUCKET",
    "PublishedCase",
    "PUBLISHED_CASES",
    "inputs_table",
    "reproduction_table",
    "sensitivity_table",
]


@dataclass(frozen=True)
class ModelPreset:
    """Parameter count and forward FLOPs per sample (2 per multiply-add) of a well-known network."""

    name: str
    params: int
    forward_flops: float
    source: str


# torchvision's model tables list multiply-adds ("GFLOPS" there = GMAC); a FLOP/s peak
# counts a fused multiply-add as 2, so forward FLOPs = 2 × GMAC.
MODELS: dict[str, ModelPreset] = {
    "resnet50": ModelPreset("resnet50", 25_557_032, 2 * 4.09e9,
                            "torchvision model table: 25,557,032 params, 4.09 GMAC at 224×224 "
                            "(He et al. 2016: 3.8 GMAC)"),
    "resnet101": ModelPreset("resnet101", 44_549_160, 2 * 7.80e9,
                             "torchvision model table: 44,549,160 params, 7.80 GMAC at 224×224 "
                             "(He et al. 2016: 7.6 GMAC)"),
    "inception_v3": ModelPreset("inception_v3", 23_851_784, 2 * 5.71e9,
                                "Keras Applications (TensorFlow, no auxiliary head): 23,851,784 params; "
                                "torchvision: 5.71 GMAC at 299×299"),
    "vgg16": ModelPreset("vgg16", 138_357_544, 2 * 15.47e9,
                         "torchvision model table: 138,357,544 params, 15.47 GMAC at 224×224"),
}


@dataclass(frozen=True)
class Hardware:
    """A figure from a vendor specification, in SI units (FLOP/s or bytes/s)."""

    value: float
    source: str


P100_SXM2_FP32 = Hardware(10.6e12, "NVIDIA Tesla P100 datasheet: 10.6 TFLOP/s fp32 (NVLink/SXM2 module)")
P100_PCIE_FP32 = Hardware(9.3e12, "NVIDIA Tesla P100 datasheet: 9.3 TFLOP/s fp32 (PCIe card)")
NVLINK1_GPU_PAIR = Hardware(40e9, "NVLink 1.0: 20 GB/s per direction per link, 2 links between paired P100s "
                                  "(IBM Redbook REDP-5405, S822LC for HPC)")
PCIE3_X16 = Hardware(15.75e9, "PCIe 3.0 x16: 8 GT/s × 16 lanes × 128/130 = 15.75 GB/s per direction")
INFINIBAND_EDR = Hardware(100e9 / 8, "InfiniBand EDR: 100 Gbit/s = 12.5 GB/s per direction")
ROCE_25G = Hardware(25e9 / 8, "25 Gbit/s Ethernet (RoCE): 3.125 GB/s per direction")

# Global assumptions: one value for every case, not tuned per case (docs/concepts/scaling.md).
# Achieved / peak FLOP/s for convolutional networks in fp32 on Pascal GPUs.
COMPUTE_EFFICIENCY = 0.5
# Seconds per message step inside a node and across the network, software included.
INTRA_NODE_LATENCY = 5e-6
NETWORK_LATENCY = 10e-6
# Gradient message size: Horovod's documented default fusion buffer (64 MB).
FUSION_BUCKET = 64 * MB


@dataclass(frozen=True)
class PublishedCase:
    """A published multi-GPU scaling result and the inputs that describe its system."""

    key: str
    system: str
    model: str
    gpus: int
    gpus_per_node: int
    accelerator: Hardware
    intra: Hardware
    inter: Hardware
    batch_per_gpu: int
    algorithm: ReduceAlgorithm  # how the published system summed gradients
    published_efficiency: float
    source: str
    batch_source: str
    gradient_bytes: int = 4
    bucket: float = FUSION_BUCKET

    def workload(self) -> Workload:
        preset = MODELS[self.model]
        return Workload(preset.params, preset.forward_flops, self.batch_per_gpu, self.gradient_bytes)

    def accelerator_model(self) -> Accelerator:
        return Accelerator(self.accelerator.value, COMPUTE_EFFICIENCY)

    def cluster(self) -> Cluster:
        return Cluster.two_level(self.gpus_per_node, self.intra.value, INTRA_NODE_LATENCY,
                                 self.inter.value, NETWORK_LATENCY)

    def predict(self, efficiency: float = COMPUTE_EFFICIENCY, intra_latency: float = INTRA_NODE_LATENCY,
                network_latency: float = NETWORK_LATENCY, bucket: float | None = None,
                bandwidth_scale: float = 1.0) -> Prediction:
        """The model's prediction; the keywords move one global assumption (for the sensitivity table)."""
        cluster = Cluster.two_level(self.gpus_per_node, self.intra.value * bandwidth_scale, intra_latency,
                                    self.inter.value * bandwidth_scale, network_latency)
        accelerator = replace(self.accelerator_model(), efficiency=efficiency)
        return predict(self.workload(), accelerator, cluster, self.gpus, self.algorithm, bucket or self.bucket)


def _horovod_benchmark(key: str, model: str, source: str) -> PublishedCase:
    """One network of Horovod's published benchmark: the same system, batch and result for each."""
    return PublishedCase(
        key=key, system="Horovod (TensorFlow, NCCL 2)", model=model, batch_per_gpu=64,
        # 128 servers × 4 Pascal GPUs on PCIe, RoCE 25 Gbit/s between them.
        gpus=512, gpus_per_node=4, accelerator=P100_PCIE_FP32, intra=PCIE3_X16, inter=ROCE_25G,
        algorithm=ReduceAlgorithm("flat-ring", "ring", reducer="flat"),
        published_efficiency=0.90,
        source=source,
        batch_source="Horovod docs/benchmarks: tf_cnn_benchmarks.py --batch_size 64 (per GPU)",
    )


PUBLISHED_CASES: tuple[PublishedCase, ...] = (
    PublishedCase(
        key="ddl-resnet50", system="IBM PowerAI DDL (Caffe)", model="resnet50", batch_per_gpu=32,
        # 64 S822LC servers × 4 P100 on NVLink, InfiniBand EDR between them.
        gpus=256, gpus_per_node=4, accelerator=P100_SXM2_FP32, intra=NVLINK1_GPU_PAIR, inter=INFINIBAND_EDR,
        # DDL's multi-ring: rings inside the node, then across nodes on the shards.
        algorithm=ReduceAlgorithm("hierarchical", "hierarchical", reducer="hierarchical"),
        published_efficiency=0.95,
        source="Cho et al., PowerAI DDL, arXiv 1708.02188: ResNet-50, 64 S822LC servers × 4 P100 (NVLink), "
               "InfiniBand EDR, 95% scaling efficiency on 256 GPUs with Caffe",
        batch_source="assumption: 32 per GPU (8192 in all), the setting of Goyal et al. (arXiv 1706.02677) that "
                     "DDL compares itself against; not re-checked against the DDL text",
    ),
    _horovod_benchmark(
        "horovod-resnet101", "resnet101",
        source="Sergeev & Del Balso, Horovod, arXiv 1802.05799, and Horovod docs/benchmarks: 128 servers × 4 Pascal "
               "GPUs, RoCE 25 Gbit/s, 90% scaling efficiency for ResNet-101 and Inception V3",
    ),
    _horovod_benchmark(
        "horovod-inception3", "inception_v3",
        source="Sergeev & Del Balso, Horovod, arXiv 1802.05799, and Horovod docs/benchmarks (as above)",
    ),
)


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g} {prefix}{unit}"
    return f"{value:g} {unit}"


def inputs_table() -> str:
    """The inputs of every published case as a Markdown table (docs/concepts/scaling.md quotes it verbatim)."""
    lines = [
        "| case | model (params, fwd FLOPs/sample) | GPUs | GPUs/node | GPU peak fp32 | intra-node | network port | "
        "batch/GPU | gradient | reducer | bucket |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in PUBLISHED_CASES:
        model = MODELS[case.model]
        lines.append(
            f"| {case.key} | {model.name} ({model.params / 1e6:.2f} M, {model.forward_flops / 1e9:.2f} G) | "
            f"{case.gpus} | {case.gpus_per_node} | {_si(case.accelerator.value, 'FLOP/s')} | "
            f"{_si(case.intra.value, 'B/s')} | {_si(case.inter.value, 'B/s')} | {case.batch_per_gpu} | "
            f"fp{8 * case.gradient_bytes} | {case.algorithm.name} | {case.bucket / MB:g} MB |"
        )
    return "\n".join(lines)


def reproduction_table() -> str:
    """Predicted against published scaling efficiency as a Markdown table (docs/concepts/scaling.md quotes it
    verbatim)."""
    lines = [
        "| case | system | GPUs | predicted step | compute | exposed comm. | predicted | published | difference |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in PUBLISHED_CASES:
        p = case.predict()
        lines.append(
            f"| {case.key} | {case.system} | {case.gpus} | {p.step_time * 1e3:.1f} ms | "
            f"{p.step.compute * 1e3:.1f} ms | {p.step.exposed * 1e3:.1f} ms | {p.efficiency:.1%} | "
            f"{case.published_efficiency:.0%} | {(p.efficiency - case.published_efficiency) * 100:+.1f} pt |"
        )
    return "\n".join(lines)


# One assumption moved at a time, everything else as in the reproduction.
_VARIATIONS: tuple[tuple[str, dict[str, float]], ...] = (
    ("as stated", {}),
    ("compute efficiency 0.4", {"efficiency": 0.4}),
    ("compute efficiency 0.6", {"efficiency": 0.6}),
    ("network latency 5 µs", {"network_latency": 5e-6}),
    ("network latency 20 µs", {"network_latency": 20e-6}),
    ("links at 80% of nominal", {"bandwidth_scale": 0.8}),
    ("bucket 25 MB", {"bucket": 25 * MB}),
    ("one bucket (no overlap)", {"bucket": 1e15}),
)


def sensitivity_table() -> str:
    """Predicted efficiency of every case as each assumption moves (docs/concepts/scaling.md quotes it verbatim)."""
    lines = [
        "| assumption | " + " | ".join(case.key for case in PUBLISHED_CASES) + " |",
        "| --- |" + " --- |" * len(PUBLISHED_CASES),
    ]
    for label, change in _VARIATIONS:
        cells = [f"{case.predict(**change).efficiency:.1%}" for case in PUBLISHED_CASES]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| published | " + " | ".join(f"{case.published_efficiency:.0%}" for case in PUBLISHED_CASES) + " |")
    return "\n".join(lines)

"""Published data-parallel scaling results, the model's prediction of each, and the leave-one-out check."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from replicator.plan.planner import FLAT_RHD, FLAT_RING, HIERARCHICAL, MB, Cluster, Prediction, ReduceAlgorithm, plan
from replicator.plan.presets import (
    DGX2H_NETWORK,
    ETHERNET_50G,
    ETHERNET_100G,
    FUSION_BUCKET,
    INFINIBAND_EDR,
    INTERFERENCE,
    INTRA_NODE_LATENCY,
    MODELS,
    NETWORK_LATENCY,
    NVLINK1_DGX1,
    NVLINK1_GPU_PAIR,
    NVLINK2_V100,
    NVLINK3_A100,
    P100_PCIE_FP32,
    P100_SXM2_FP32,
    PCIE3_X16,
    ROCE_25G,
    Hardware,
)
from replicator.plan.step import Accelerator, Workload
from replicator.plan.transports import transport

__all__ = [
    "Link",
    "Assumptions",
    "ASSUMPTIONS",
    "MODEL",
    "PublishedCase",
    "PUBLISHED_CASES",
    "covered",
    "fit_interference",
    "fitted_assumptions",
    "leave_one_out",
    "inputs_table",
    "reproduction_table",
    "leave_one_out_table",
    "sources_table",
]

@dataclass(frozen=True)
class Link:
    """A link's line rate (one direction) and the kind of transport over it (transports.TRANSPORTS)."""

    rate: Hardware
    kind: str

    @property
    def efficiency(self) -> float:
        return transport(self.kind).efficiency


@dataclass(frozen=True)
class Assumptions:
    """What every case shares. `interference` is the share of overlapped all-reduce time that still lengthens
    the step (all-reduce kernels take memory bandwidth and SMs from backward): the one constant fitted to
    the published rows (fit_interference), refitted without each row for the leave-one-out check."""

    intra_latency: float = INTRA_NODE_LATENCY
    network_latency: float = NETWORK_LATENCY
    interference: float = 0.0


# The stated assumptions before the fit (fitted_assumptions() adds the fitted interference).
ASSUMPTIONS = Assumptions()
# The validated model: the stated assumptions with the fitted interference, as `replicator plan` uses them
# (presets.INTERFERENCE; tests/plan/test_published.py checks that fitted_assumptions() gives it).
MODEL = Assumptions(interference=INTERFERENCE)


@dataclass(frozen=True)
class PublishedCase:
    """A published data-parallel scaling result and the inputs that describe its system.

    `throughput` is one device's measured samples/s at `batch_per_gpu` (replacing a FLOPs
    estimate); `bucket`/`first_bucket` the system's gradient messages (elements × bytes);
    `baseline_gpus` the count the publication's efficiency is relative to. `outside` says
    why the model cannot explain the loss, for a row it does not claim ("" otherwise).
    """

    key: str
    system: str
    model: str
    gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link
    batch_per_gpu: int
    throughput: Hardware
    algorithm: ReduceAlgorithm
    published_efficiency: float
    source: str
    gradient_bytes: int = 4
    bucket: float = FUSION_BUCKET
    first_bucket: float | None = None
    baseline_gpus: int = 1
    outside: str = ""

    def workload(self) -> Workload:
        preset = MODELS[self.model]
        return Workload(preset.params, preset.forward_flops, self.batch_per_gpu, self.gradient_bytes,
                        step_s=self.batch_per_gpu / self.throughput.value, profile=preset.profile())

    def cluster(self, assumptions: Assumptions = MODEL) -> Cluster:
        return Cluster.two_level(self.gpus_per_node, self.intra.rate.value, assumptions.intra_latency,
                                 self.inter.rate.value, assumptions.network_latency,
                                 self.intra.efficiency, self.inter.efficiency)

    def prediction(self, assumptions: Assumptions = MODEL, gpus: int | None = None) -> Prediction:
        """The row predicted through `planner.plan`, the sweep `replicator plan` runs, with this system's one
        algorithm and message size: `arguments()` typed on the command line gives the same prediction."""
        # The measured step replaces FLOPs; the peak given here is never used.
        accelerator = Accelerator(1.0, overlap=1.0 - assumptions.interference)
        count = gpus or self.gpus
        result = plan(self.workload(), accelerator, self.cluster(assumptions), [count], [self.algorithm],
                      [self.bucket], first_bucket=self.first_bucket or self.bucket)
        return result.recommended[count]

    def predict(self, assumptions: Assumptions = MODEL) -> float:
        """Predicted scaling efficiency against the publication's baseline (1 GPU, or `baseline_gpus`)."""
        at_scale = self.prediction(assumptions)
        if self.baseline_gpus == 1:
            return at_scale.efficiency
        return self.prediction(assumptions, self.baseline_gpus).step_time / at_scale.step_time

    def arguments(self) -> list[str]:
        """This row as `replicator plan` flags (exact values; printed figures then agree with `--reproduce`).

        Every input is a fact about the system; the latencies and the interference are the model's defaults.
        """
        flags = {
            "--model": self.model, "--max-gpus": self.gpus, "--gpus-per-node": self.gpus_per_node,
            "--intra-bw": self.intra.rate.value / 1e9, "--intra-transport": self.intra.kind,
            "--inter-bw": self.inter.rate.value / 1e9, "--inter-transport": self.inter.kind,
            "--batch-per-gpu": self.batch_per_gpu, "--samples-per-s": self.throughput.value,
            "--gradient-dtype": _GRADIENT_DTYPES[self.gradient_bytes], "--all-reduce": self.algorithm.algorithm,
            "--bucket-mb": self.bucket / MB, "--first-bucket-mb": (self.first_bucket or self.bucket) / MB,
            "--baseline-gpus": self.baseline_gpus,
        }
        return [text for flag, value in flags.items() for text in (flag, repr(value) if isinstance(value, float)
                                                                     else str(value))]


_GRADIENT_DTYPES = {4: "float32", 2: "float16"}


def _scaled(figure: Hardware, ratio: float, why: str) -> Hardware:
    return Hardware(figure.value * ratio, f"{figure.source}; {why}")


# One device's measured throughput, from the sources the rows cite.
_TF_P100 = "TensorFlow performance benchmarks (tensorflow docs_src/performance/benchmarks.md, 2017): DGX-1 P100, " \
           "synthetic data, batch 64, 1 GPU"
_PCIE = "× 9.3/10.6: the Horovod cluster's Pascal GPUs taken as P100 PCIe, slower by the ratio of peaks"
P100_RESNET50 = Hardware(238.0, f"{_TF_P100}: ResNet-50 238 images/s")
P100_INCEPTION3 = Hardware(142.0, f"{_TF_P100}: Inception V3 142 images/s")
P100_VGG16 = Hardware(132.0, f"{_TF_P100}: VGG16 132 images/s")
# Not in that table: its achieved FLOP/s interpolated in depth between ResNet-50 (5.84 TFLOP/s) and ResNet-152.
P100_RESNET101 = Hardware(
    (5.84e12 + (101 - 50) / (152 - 50) * (95.6 * 3 * 2 * 11.51e9 - 5.84e12)) / (3 * 2 * 7.80e9),
    f"{_TF_P100}: derived, ResNet-101 is not in the table; ResNet-50 (238/s) and ResNet-152 (95.6/s) achieve "
    "5.84 and 6.60 TFLOP/s, interpolated by depth to 6.22 TFLOP/s")
_DLE_BERT = ("NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT/README.md (NGC 19.07), "
             "1 GPU of a DGX-2 (V100 32G)")
_DLE_RN50 = "NVIDIA DeepLearningExamples TensorFlow/Classification/ConvNets/resnet50v1.5/README.md (NGC 20.06), 1 GPU"
_HOROVOD = ("Horovod docs/benchmarks (github.com/horovod/horovod): 128 servers × 4 Pascal GPUs, "
            "RoCE-capable 25 Gbit/s, 90% for Inception V3 and ResNet-101, 68% for VGG-16")
_HOROVOD_128 = ("earlier revision of Horovod docs/benchmarks: 32 servers × 4 Pascal GPUs, RoCE 25 Gbit/s, 90% for "
                "Inception V3 and ResNet-101, 79% for VGG-16")
_HOROVOD_TCP = ("Sergeev & Del Balso, arXiv 1802.05799, §8 (read through transcriptions): 128 GPUs over TCP, "
                "88% for Inception V3 and ResNet-101")
_SQUAD = ("NVIDIA DeepLearningExamples BERT README, \"Fine-tuning NVIDIA DGX-2 With 32G\" (16 GPUs; apex DDP with "
          "message_size=250,000,000 elements, run_squad.py)")
_RN50_LOSS = ("a single node: the model puts the all-reduce of ResNet-50's gradient at about 1 ms of a step of "
              "100-200 ms; the loss is elsewhere (input pipeline, host), which an alpha–beta model does not contain")


def _horovod(key: str, model: str, gpus: int, efficiency: float, rate: Hardware, source: str,
             network: str = "roce") -> PublishedCase:
    return PublishedCase(
        key, "Horovod (TensorFlow, NCCL 2)", model, gpus, 4, Link(PCIE3_X16, "pcie"), Link(ROCE_25G, network), 64,
        _scaled(rate, P100_PCIE_FP32.value / P100_SXM2_FP32.value, _PCIE), FLAT_RING, efficiency, source)


def _dle_resnet50(key: str, gpus: int, intra: Hardware, batch: int, rate: float, efficiency: float, gpu: str,
                  precision: str) -> PublishedCase:
    return PublishedCase(
        key, "TensorFlow + Horovod (NVIDIA DLE)", "resnet50", gpus, gpus, Link(intra, "nvlink"),
        Link(INFINIBAND_EDR, "infiniband"), batch,
        Hardware(rate, f"{_DLE_RN50} ({gpu}, {precision}): {rate:g} images/s at batch {batch}"),
        FLAT_RING, efficiency, f"{_DLE_RN50}: {gpus} GPUs {precision}, weak scaling {efficiency * gpus:.2f}/{gpus}",
        outside=_RN50_LOSS)


PUBLISHED_CASES: tuple[PublishedCase, ...] = (
    PublishedCase(
        "ddl-resnet50", "IBM PowerAI DDL (Caffe)", "resnet50", 256, 4, Link(NVLINK1_GPU_PAIR, "nvlink"),
        Link(INFINIBAND_EDR, "infiniband"), 32, P100_RESNET50, HIERARCHICAL, 0.95,
        "Cho et al., PowerAI DDL, arXiv 1708.02188, as reported by TOP500 News and IBM Research: ResNet-50 on "
        "64 S822LC × 4 P100 (NVLink), InfiniBand, 95% on 256 GPUs with Caffe; batch 32/GPU and 64 MB messages "
        "are assumptions"),
    _horovod("horovod-resnet101-512", "resnet101", 512, 0.90, P100_RESNET101, _HOROVOD),
    _horovod("horovod-inception3-512", "inception_v3", 512, 0.90, P100_INCEPTION3, _HOROVOD),
    _horovod("horovod-vgg16-512", "vgg16", 512, 0.68, P100_VGG16, _HOROVOD),
    _horovod("horovod-resnet101-128", "resnet101", 128, 0.90, P100_RESNET101, _HOROVOD_128),
    _horovod("horovod-inception3-128", "inception_v3", 128, 0.90, P100_INCEPTION3, _HOROVOD_128),
    _horovod("horovod-vgg16-128", "vgg16", 128, 0.79, P100_VGG16, _HOROVOD_128),
    _horovod("horovod-tcp-resnet101-128", "resnet101", 128, 0.88, P100_RESNET101, _HOROVOD_TCP, "tcp"),
    _horovod("horovod-tcp-inception3-128", "inception_v3", 128, 0.88, P100_INCEPTION3, _HOROVOD_TCP, "tcp"),
    PublishedCase(
        "goyal-resnet50-256", "Caffe2 + Gloo (Facebook Big Basin)", "resnet50", 256, 8, Link(NVLINK1_DGX1, "nvlink"),
        Link(ETHERNET_50G, "roce"), 32, P100_RESNET50, FLAT_RHD, 0.90,
        "Goyal et al., arXiv 1706.02677, §4.3, §5.5: 32 servers × 8 P100 (NVLink), 50 Gbit/s Ethernet "
        "(ConnectX-4), ~90% relative to 8 GPUs; recursive halving-doubling per layer as backward produces it",
        bucket=1.0, baseline_gpus=8),
    PublishedCase(
        "megatron-gpt2-1.2b-64", "Megatron-LM (PyTorch, NCCL)", "gpt2_1.2b", 64, 16, Link(NVLINK2_V100, "nvlink"),
        Link(DGX2H_NETWORK, "infiniband"), 8,
        Hardware(39e12 / (3 * 2 * 1.369e12),
                 "Shoeybi et al., arXiv 1909.08053, §5.1: 39 TFLOP/s on one V100 for the 1.2B model; samples/s = "
                 "39 TFLOP/s over 3 × the counted forward FLOPs of 1,024 tokens"),
        FLAT_RING, 0.96,
        "Shoeybi et al., arXiv 1909.08053, Fig. 5: 96% for 64-way data parallelism of the 1.2B model on DGX-2H "
        "(16 V100, NVSwitch; 8 InfiniBand adapters); its local DDP all-reduces fp16 gradients after backward",
        gradient_bytes=2, bucket=2 * 1_213_479_936),
    PublishedCase(
        "byteps-horovod-bert-large-256", "Horovod + NCCL (MXNet)", "bert_large", 256, 8, Link(NVLINK2_V100, "nvlink"),
        Link(ETHERNET_100G, "roce"), 64,
        Hardware(181.76, f"{_DLE_BERT}: 181.76 sequences/s at batch 64, 128 tokens, mixed precision (a PyTorch "
                         "figure standing in for MXNet's; the BytePS README gives none)"),
        FLAT_RING, 0.70,
        "BytePS README (github.com/bytedance/byteps, Jiang et al. OSDI 2020): BERT-large on 256 V100 (32 machines, "
        "100 Gb/s RDMA), Horovod + NCCL \"only ~70% scaling efficiency\"", gradient_bytes=2),
    PublishedCase(
        "dle-squad-bert-large-16-fp16", "PyTorch + apex DDP (NVIDIA DLE)", "bert_large", 16, 16,
        Link(NVLINK2_V100, "nvlink"), Link(INFINIBAND_EDR, "infiniband"), 4,
        Hardware(38.16, f"{_DLE_BERT}, fine-tuning: 38.16 sequences/s at batch 4, mixed precision"), FLAT_RING,
        0.757, f"{_SQUAD}: mixed precision, batch 4, weak scaling 12.11/16", gradient_bytes=2,
        bucket=250e6 * 2),
    PublishedCase(
        "dle-squad-bert-large-16-fp32", "PyTorch + apex DDP (NVIDIA DLE)", "bert_large", 16, 16,
        Link(NVLINK2_V100, "nvlink"), Link(INFINIBAND_EDR, "infiniband"), 4,
        Hardware(9.92, f"{_DLE_BERT}, fine-tuning: 9.92 sequences/s at batch 4, fp32"), FLAT_RING,
        0.891, f"{_SQUAD}: fp32, batch 4, weak scaling 14.25/16", bucket=250e6 * 4),
    PublishedCase(
        "dle-squad-bert-large-16-fp16-b10", "PyTorch + apex DDP (NVIDIA DLE)", "bert_large", 16, 16,
        Link(NVLINK2_V100, "nvlink"), Link(INFINIBAND_EDR, "infiniband"), 10,
        Hardware(47.40, f"{_DLE_BERT}, fine-tuning: 47.40 sequences/s at batch 10, mixed precision"), FLAT_RING,
        0.854, f"{_SQUAD}: mixed precision, batch 10, weak scaling 13.67/16", gradient_bytes=2,
        bucket=250e6 * 2),
    _dle_resnet50("dle-resnet50-dgx2-amp", 16, NVLINK2_V100, 256, 1300, 0.829, "DGX-2 V100", "mixed precision"),
    _dle_resnet50("dle-resnet50-dgx2-fp32", 16, NVLINK2_V100, 128, 432, 0.941, "DGX-2 V100", "fp32"),
    _dle_resnet50("dle-resnet50-dgx1-amp", 8, NVLINK2_V100, 256, 1270, 0.935, "DGX-1 V100", "mixed precision"),
    _dle_resnet50("dle-resnet50-dgx1-fp32", 8, NVLINK2_V100, 128, 412, 0.961, "DGX-1 V100", "fp32"),
    _dle_resnet50("dle-resnet50-a100-amp", 8, NVLINK3_A100, 256, 2375, 0.915, "DGX A100", "mixed precision"),
    _dle_resnet50("dle-resnet50-a100-tf32", 8, NVLINK3_A100, 256, 909, 0.963, "DGX A100", "TF32"),
)


def covered(cases: Sequence[PublishedCase] = PUBLISHED_CASES) -> list[PublishedCase]:
    """The rows whose loss the model claims to explain (every row not marked `outside`)."""
    return [case for case in cases if not case.outside]


def fit_interference(cases: Sequence[PublishedCase], base: Assumptions = ASSUMPTIONS) -> float:
    """The interference in [0, 1] with the least squared error over `cases`: a grid, then a finer one near the best."""
    def loss(value: float) -> float:
        stated = replace(base, interference=value)
        return sum((case.predict(stated) - case.published_efficiency) ** 2 for case in cases)

    best = min((k / 20 for k in range(21)), key=loss)
    return min((max(0.0, min(1.0, best + k / 400)) for k in range(-20, 21)), key=loss)


def fitted_assumptions(cases: Sequence[PublishedCase] | None = None) -> Assumptions:
    """The stated assumptions with the interference fitted to the covered rows."""
    return replace(ASSUMPTIONS, interference=fit_interference(covered() if cases is None else cases))


def leave_one_out(cases: Sequence[PublishedCase] | None = None) -> list[tuple[PublishedCase, float, float]]:
    """(case, interference fitted without it, its predicted efficiency then) for every covered case."""
    rows = covered() if cases is None else list(cases)
    result = []
    for case in rows:
        others = [other for other in rows if other is not case]
        value = fit_interference(others)
        result.append((case, value, case.predict(replace(ASSUMPTIONS, interference=value))))
    return result


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def inputs_table() -> str:
    """The inputs of every published case as a Markdown table (docs/concepts/scaling.md quotes it verbatim)."""
    lines = [
        "| case | model | GPUs (per node) | 1-GPU samples/s | batch/GPU | intra-node | network | gradient | reducer | "
        "message |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in PUBLISHED_CASES:
        base = "" if case.baseline_gpus == 1 else f", vs {case.baseline_gpus}"
        lines.append(
            f"| {case.key} | {case.model} | {case.gpus} ({case.gpus_per_node}{base}) | {case.throughput.value:.4g} | "
            f"{case.batch_per_gpu} | {_si(case.intra.rate.value, 'B/s')} {case.intra.kind} | "
            f"{_si(case.inter.rate.value, 'B/s')} {case.inter.kind} | fp{8 * case.gradient_bytes} | "
            f"{case.algorithm.name} | {'per layer' if case.bucket <= 1 else f'{case.bucket / MB:.4g} MB'} |")
    return "\n".join(lines)


def reproduction_table(assumptions: Assumptions | None = None) -> str:
    """Predicted against published efficiency for every case (docs/concepts/scaling.md quotes it verbatim)."""
    stated = assumptions or MODEL
    lines = [
        "| case | GPUs | step | compute | exposed | of which tail | predicted | published | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in PUBLISHED_CASES:
        p = case.prediction(stated)
        efficiency = case.predict(stated)
        mark = " †" if case.outside else ""
        lines.append(
            f"| {case.key}{mark} | {case.gpus} | {p.step_time * 1e3:.1f} ms | {p.step.compute * 1e3:.1f} ms | "
            f"{p.step.exposed * 1e3:.1f} ms | {p.step.tail * 1e3:.1f} ms | {efficiency:.1%} | "
            f"{case.published_efficiency:.1%} | {(efficiency - case.published_efficiency) * 100:+.1f} pt |")
    errors = [abs(case.predict(stated) - case.published_efficiency) * 100 for case in covered()]
    lines.append(f"\nInterference {stated.interference:.3f}; covered rows ({len(errors)}): largest error "
                 f"{max(errors):.1f} pt, median {statistics.median(errors):.1f} pt.")
    return "\n".join(lines)


def leave_one_out_table() -> str:
    """Each covered case predicted with the interference fitted without it (docs/concepts/scaling.md quotes it)."""
    lines = ["| case | interference without it | predicted | published | error |", "| --- | --- | --- | --- | --- |"]
    errors = []
    for case, value, efficiency in leave_one_out():
        errors.append(abs(efficiency - case.published_efficiency) * 100)
        lines.append(f"| {case.key} | {value:.3f} | {efficiency:.1%} | {case.published_efficiency:.1%} | "
                     f"{(efficiency - case.published_efficiency) * 100:+.1f} pt |")
    lines.append(f"\nLargest leave-one-out error {max(errors):.1f} pt, median {statistics.median(errors):.1f} pt.")
    return "\n".join(lines)


def sources_table() -> str:
    """Where each row's published efficiency and one-device throughput come from (quoted in the docs)."""
    lines = ["| case | published result | one-device throughput |", "| --- | --- | --- |"]
    for case in PUBLISHED_CASES:
        lines.append(f"| {case.key} | {case.source} | {case.throughput.source} |")
    return "\n".join(lines)

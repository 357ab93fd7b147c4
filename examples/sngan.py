"""A class-conditional SN-GAN on scikit-learn's handwritten digits, with batch norm over the global batch.

    python examples/sngan.py                                        # 1 replica, global batch 64
    replicator launch -n 2 examples/sngan.py --global-batch 256     # 2 replicas of 128
    python examples/sngan.py --global-batch 256 --accumulate 2      # BigGAN-PyTorch's workaround: 2 x 128 accumulated
    python examples/sngan.py --sweep                                # global batch 32..256 x 3 seeds: table and plot

TF-Replicator's second workload (Buchlovsky et al. 2019, section 5.2), at digit scale. The
generator is class-conditional through conditional batch norm (a gain and bias per class)
whose statistics span all replicas (`rp.nn.CrossReplicaConditionalBatchNorm`): N replicas
with batch B/N each compute what one process with batch B would. The discriminator has
spectral normalization on every weight (`torch.nn.utils.parametrizations.spectral_norm`) and
a projection head (Miyato & Koyama 2018); the loss is the hinge loss; each step takes
`--n-dis` discriminator updates and one generator update, with two wrapped Adam optimizers
(betas (0, 0.9), as SN-GAN). Every replica draws the noise of the whole global batch and
keeps its own rows, so a run on N replicas sees exactly the noise one process would.

Spectral norm's power iteration runs in every training-mode forward of the discriminator,
from its weights alone: replicas stay identical because each calls it equally often
(replicator names the `_u`/`_v` buffers if they part). Gradient accumulation runs it once
per micro-batch, which is why `--accumulate` is a different algorithm from a large batch.

The digits (1,797 of them, 8x8, no download) are split 80/20 once; the GAN trains on the 80%,
the scores (examples/sngan_eval.py: conditional accuracy, an Inception-like score, a
Fréchet distance on a digits classifier's features, the classification accuracy score)
compare generated digits with the held-out 20%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import sngan_eval  # next to this file: the script's directory is on the path when it runs
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

import replicator as rp

NUM_CLASSES = 10

# -- data ------------------------------------------------------------------------------------------


def load_digits(image_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train, held-out) digits as images in [-1, 1] of `image_size` pixels and labels; the same split every run."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8 - 1  # 0..16 -> -1..1
    if image_size != images.shape[-1]:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    train, held_out = train_test_split(range(len(labels)), test_size=0.2, random_state=0, stratify=digits.target)
    return (images[train], labels[train]), (images[held_out], labels[held_out])


# -- the models --------------------------------------------------------------------------------------


class GeneratorBlock(nn.Module):
    """Conditional batch norm, ReLU, 2x nearest upsampling, 3x3 convolution."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm = rp.nn.CrossReplicaConditionalBatchNorm(in_channels, NUM_CLASSES)
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)  # the next norm cancels a bias

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(F.relu(self.norm(x, labels)), scale_factor=2, mode="nearest"))


class Generator(nn.Module):
    """(noise, class) -> image in [-1, 1]: linear to 4x4, upsampling blocks to the image size, a 3x3 to 1 channel."""

    def __init__(self, z_dim: int = 32, width: int = 32, image_size: int = 8) -> None:
        super().__init__()
        doublings = int(math.log2(image_size // 4))
        if 4 * 2**doublings != image_size:
            raise ValueError(f"image_size must be 4 times a power of two, got {image_size}")
        self.width = width
        self.linear = nn.Linear(z_dim, width * 16, bias=False)
        self.blocks = nn.ModuleList(GeneratorBlock(width, width) for _ in range(doublings))
        self.norm = rp.nn.CrossReplicaConditionalBatchNorm(width, NUM_CLASSES)
        self.out = nn.Conv2d(width, 1, 3, padding=1)

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.linear(z).view(-1, self.width, 4, 4)
        for block in self.blocks:
            x = block(x, labels)
        return torch.tanh(self.out(F.relu(self.norm(x, labels))))


class Discriminator(nn.Module):
    """Spectral-normed convolutions, strided down to 4x4, summed over space; a linear score plus the projection
    <embed(class), features> (Miyato & Koyama 2018): real digits of the right class score high."""

    def __init__(self, width: int = 32, image_size: int = 8) -> None:
        super().__init__()
        layers: list[nn.Module] = [spectral_norm(nn.Conv2d(1, width, 3, padding=1)), nn.LeakyReLU(0.1)]
        channels, size = width, image_size
        while size > 4:
            layers += [spectral_norm(nn.Conv2d(channels, 2 * channels, 4, stride=2, padding=1)), nn.LeakyReLU(0.1)]
            channels, size = 2 * channels, size // 2
        self.body = nn.Sequential(*layers)
        self.linear = spectral_norm(nn.Linear(channels, 1))
        self.embed = spectral_norm(nn.Embedding(NUM_CLASSES, channels))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = self.body(images).sum(dim=(2, 3))
        return self.linear(features).squeeze(1) + (self.embed(labels) * features).sum(dim=1)


# -- one training step: n_dis discriminator updates, one generator update -----------------------------


class GlobalNoise:
    """Noise and fake classes for the whole global batch, drawn alike on every replica; each keeps its rows.

    Drawing the global batch costs next to nothing and makes the noise independent of how many
    replicas share the batch: N replicas with B/N each see what one process with B would.
    """

    def __init__(self, z_dim: int, seed: int, replica: int, replicas: int) -> None:
        self.z_dim, self.replica, self.replicas = z_dim, replica, replicas
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, per_replica: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        total = per_replica * self.replicas
        z = torch.randn(total, self.z_dim, generator=self.generator, dtype=dtype)
        labels = torch.randint(0, NUM_CLASSES, (total,), generator=self.generator)
        mine = slice(self.replica * per_replica, (self.replica + 1) * per_replica)
        return z[mine], labels[mine]


def make_step(repl: rp.Replicator, generator: Generator, discriminator: Discriminator,
              g_optimizer: torch.optim.Optimizer, d_optimizer: torch.optim.Optimizer, noise: GlobalNoise,
              n_dis: int, accumulate: int = 1) -> Callable[[rp.ReplicaContext, Any], torch.Tensor]:
    """step_fn for repl.run: the batch holds n_dis x accumulate x b real digits of this replica.

    With `accumulate` > 1 each update averages the gradients of that many micro-batches of b,
    communicating on the last only (repl.no_sync()): BigGAN-PyTorch's road to a large batch,
    where batch norm sees b samples and the power iteration runs once per micro-batch.
    """

    def micro_batches() -> list[contextlib.AbstractContextManager[None]]:
        return [repl.no_sync() if i < accumulate - 1 else contextlib.nullcontext() for i in range(accumulate)]

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        b = len(images) // (n_dis * accumulate)
        reals, classes = images.view(n_dis, accumulate, b, *images.shape[1:]), labels.view(n_dis, accumulate, b)
        for d_step in range(n_dis):
            d_optimizer.zero_grad()
            for micro, quiet in enumerate(micro_batches()):
                z, fake_classes = noise(b, images.dtype)
                with torch.no_grad():
                    fakes = generator(z, fake_classes)  # train mode: global-batch statistics, as the G step sees
                with quiet:
                    d_loss = (F.relu(1 - discriminator(reals[d_step, micro], classes[d_step, micro])).mean()
                              + F.relu(1 + discriminator(fakes, fake_classes)).mean())
                    (d_loss / accumulate).backward()
            d_optimizer.step()
        discriminator.requires_grad_(False)  # the G step needs gradients through D, not for it
        g_optimizer.zero_grad()
        for quiet in micro_batches():
            z, fake_classes = noise(b, images.dtype)
            with quiet:
                g_loss = -discriminator(generator(z, fake_classes), fake_classes).mean()
                (g_loss / accumulate).backward()
        g_optimizer.step()
        discriminator.requires_grad_(True)
        return ctx.all_mean(torch.stack([d_loss.detach(), g_loss.detach()]))

    return step_fn


# -- training and evaluation -------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--global-batch", type=int, default=64, help="samples per discriminator update, all replicas")
    parser.add_argument("--steps", type=int, default=1200, help="generator updates")
    parser.add_argument("--n-dis", type=int, default=2, help="discriminator updates per generator update")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per update (gradient accumulation)")
    parser.add_argument("--image-size", type=int, default=8, help="8 (the digits as they are), 16 or 32 (bilinear)")
    parser.add_argument("--z-dim", type=int, default=32)
    parser.add_argument("--g-width", type=int, default=16)
    parser.add_argument("--d-width", type=int, default=16)
    parser.add_argument("--g-lr", type=float, default=1e-3)
    parser.add_argument("--d-lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default="runs/sngan", help="the cached classifier, samples and results")
    parser.add_argument("--eval-per-class", type=int, default=100, help="generated digits per class to score")
    parser.add_argument("--no-cas", action="store_true", help="skip the classification accuracy score")
    parser.add_argument("--result", default=None, help="replica 0 writes the run's figures here as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--sweep", action="store_true", help="the batch-size experiment (see sweep())")
    parser.add_argument("--sweep-batches", default="32,64,128,256")
    parser.add_argument("--sweep-seeds", type=int, default=3)
    parser.add_argument("--max-replicas", type=int, default=min(os.cpu_count() or 1, 8),
                        help="the sweep's most replicas per run; larger batches then grow each replica's share")
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train on every replica; replica 0 then scores the generator and writes the grid and figures."""
    (train_images, train_labels), held_out = load_digits(args.image_size)
    torch.manual_seed(args.seed)
    repl = rp.Replicator()
    with repl.scope():
        generator = Generator(args.z_dim, args.g_width, args.image_size)
        discriminator = Discriminator(args.d_width, args.image_size)
        g_optimizer = repl.wrap_optimizer(torch.optim.Adam(generator.parameters(), lr=args.g_lr, betas=(0.0, 0.9)))
        d_optimizer = repl.wrap_optimizer(torch.optim.Adam(discriminator.parameters(), lr=args.d_lr, betas=(0.0, 0.9)))
    per_replica = args.global_batch // (repl.num_replicas * args.accumulate)
    if per_replica * repl.num_replicas * args.accumulate != args.global_batch:
        raise SystemExit(f"--global-batch {args.global_batch} must divide into {repl.num_replicas} replicas x "
                         f"{args.accumulate} micro-batches")
    dataset = torch.utils.data.TensorDataset(train_images, train_labels)

    def input_fn(ctx: rp.InputContext) -> torch.utils.data.DataLoader:
        reals_per_step = per_replica * args.accumulate * args.n_dis  # every D update takes fresh real digits
        return torch.utils.data.DataLoader(dataset, batch_size=reals_per_step, drop_last=True,
                                           sampler=ctx.sampler(dataset, shuffle=True, seed=args.seed, drop_last=True))

    noise = GlobalNoise(args.z_dim, seed=10_000 + args.seed, replica=repl.replica_id, replicas=repl.num_replicas)
    step_fn = make_step(repl, generator, discriminator, g_optimizer, d_optimizer, noise, args.n_dis, args.accumulate)
    losses = []
    started = time.perf_counter()
    for _, loss in repl.run(step_fn, repl.prepare_input(input_fn), steps=args.steps, progress=not args.quiet):
        losses.append([float(x) for x in loss])
    seconds = time.perf_counter() - started
    result: dict[str, Any] = {
        "replicas": repl.num_replicas, "global_batch": args.global_batch, "per_replica_batch": per_replica,
        "accumulate": args.accumulate, "steps": args.steps, "n_dis": args.n_dis, "seed": args.seed,
        "image_size": args.image_size, "train_seconds": seconds, "d_loss_last": losses[-1][0],
        "g_loss_last": losses[-1][1],
    }
    if repl.is_main:  # the others are done: evaluation needs no partner (eval mode, running statistics)
        result |= evaluate(generator, args, (train_images, train_labels), held_out)
        repl.print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
        if args.result:
            with open(args.result, "w") as handle:
                json.dump(result, handle, indent=2)
    repl.barrier()
    return result


@torch.no_grad()
def evaluate(generator: Generator, args: argparse.Namespace, train_set: tuple[torch.Tensor, torch.Tensor],
             held_out: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """The scores of `--eval-per-class` samples of every class, and a grid of 10 of each."""
    classifier, accuracy = sngan_eval.cached_classifier(args.run_dir, args.image_size, train_set, held_out)
    generator.eval()
    seeded = torch.Generator().manual_seed(123)  # the same evaluation noise for every run
    requested = torch.arange(NUM_CLASSES).repeat_interleave(args.eval_per_class)
    z = torch.randn(len(requested), args.z_dim, generator=seeded)
    samples = generator(z, requested)
    generator.train()
    reference = train_set[0][torch.randperm(len(train_set[0]), generator=seeded)[: len(held_out[0])]]
    scores = sngan_eval.scores(classifier, samples, requested, held_out, args.image_size, real_reference=reference,
                               cas=not args.no_cas)
    tag = f"b{args.global_batch}_r{int(os.environ.get('WORLD_SIZE', 1))}_a{args.accumulate}_s{args.seed}"
    grid = os.path.join(args.run_dir, f"samples_{tag}.png")
    shown = torch.cat([samples[c * args.eval_per_class : c * args.eval_per_class + 10] for c in range(NUM_CLASSES)])
    sngan_eval.save_grid(shown, grid, rows=NUM_CLASSES, title=f"global batch {args.global_batch}, seed {args.seed}")
    return {"classifier_test_accuracy": accuracy, **scores, "grid": grid}


# -- the batch-size experiment -------------------------------------------------------------------------


def sweep(args: argparse.Namespace) -> None:
    """Same generator steps at each global batch, 3 seeds; plus 2 x 128 as accumulation with local batch norm.

    Each run is its own job under `replicator launch`, with as many replicas as the batch
    allows up to --max-replicas at the smallest batch's per-replica share; beyond that, each
    replica's share grows. Prints the table, writes it as JSON and plots it.
    """
    from replicator.launch import LaunchSpec, launch

    os.makedirs(args.run_dir, exist_ok=True)
    (train_images, train_labels), held_out = load_digits(args.image_size)
    _, accuracy = sngan_eval.cached_classifier(args.run_dir, args.image_size, (train_images, train_labels), held_out)
    print(f"digits classifier: {100 * accuracy:.1f}% test accuracy (cached in {args.run_dir})", flush=True)
    batches = [int(b) for b in args.sweep_batches.split(",")]
    smallest = min(batches)
    runs: list[tuple[str, int, int, int]] = []  # (label, global batch, replicas, accumulate)
    for batch in batches:
        replicas = max(r for r in range(1, args.max_replicas + 1) if batch % r == 0 and r * smallest <= batch)
        runs.append((f"{replicas} x {batch // replicas}", batch, replicas, 1))
    largest = max(batches)
    runs.append((f"1 x {largest // 2} x 2 accumulated", largest, 1, 2))
    shared = ["--steps", str(args.steps), "--n-dis", str(args.n_dis), "--image-size", str(args.image_size),
              "--z-dim", str(args.z_dim), "--g-width", str(args.g_width), "--d-width", str(args.d_width),
              "--g-lr", str(args.g_lr), "--d-lr", str(args.d_lr), "--run-dir", args.run_dir,
              "--eval-per-class", str(args.eval_per_class), "--quiet", *(["--no-cas"] if args.no_cas else [])]
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    for seed in range(args.sweep_seeds):  # seeds outermost: a cut-short sweep still has every batch
        for label, batch, replicas, accumulate in runs:
            path = os.path.join(args.run_dir, f"result_b{batch}_r{replicas}_a{accumulate}_s{seed}.json")
            # One thread per replica: a replica's work is the same at every replica count.
            spec = LaunchSpec(target=os.path.abspath(__file__), nproc_per_node=replicas, threads_per_process=1,
                              args=[*shared, "--global-batch", str(batch), "--accumulate", str(accumulate),
                                    "--seed", str(seed), "--result", path])
            began = time.perf_counter()
            if launch(spec) != 0 or not os.path.exists(path):
                raise SystemExit(f"the run {label}, seed {seed} failed")
            with open(path) as handle:
                results.append({"label": label, **json.load(handle), "wall_seconds": time.perf_counter() - began})
            print(f"[{time.perf_counter() - started:.0f} s] {label}, seed {seed}: "
                  f"FID-digits {results[-1]['fid_digits']:.2f}, "
                  f"conditional accuracy {100 * results[-1]['conditional_accuracy']:.1f}%", flush=True)
    table = summarize(results, runs)
    print_table(table, args, accuracy, time.perf_counter() - started)
    summary = {"args": vars(args), "classifier_test_accuracy": accuracy, "table": table, "runs": results,
               "seconds": time.perf_counter() - started}
    with open(os.path.join(args.run_dir, "sweep.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
    plot(table, os.path.join(args.run_dir, "sweep.png"))
    print(f"table and runs in {os.path.join(args.run_dir, 'sweep.json')}, plot in "
          f"{os.path.join(args.run_dir, 'sweep.png')}")


SCORES = ("fid_digits", "conditional_accuracy", "inception_score", "cas")


def summarize(results: list[dict[str, Any]], runs: list[tuple[str, int, int, int]]) -> list[dict[str, Any]]:
    """One row per configuration: the median and range over seeds of every score."""
    rows = []
    for label, batch, replicas, accumulate in runs:
        mine = [r for r in results if r["label"] == label]
        row: dict[str, Any] = {"label": label, "global_batch": batch, "replicas": replicas, "accumulate": accumulate,
                               "seeds": len(mine), "train_seconds": statistics.median(r["train_seconds"] for r in mine)}
        for score in (*SCORES, "fid_digits_real_vs_real"):
            values = [r[score] for r in mine if score in r]
            if values:
                row[score] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        rows.append(row)
    return rows


def print_table(table: list[dict[str, Any]], args: argparse.Namespace, accuracy: float, seconds: float) -> None:
    print(f"\nSN-GAN on digits, {args.steps} generator steps (n_dis {args.n_dis}), {args.image_size}x{args.image_size},"
          f" medians [min, max] over seeds; classifier test accuracy {100 * accuracy:.1f}%; {seconds:.0f} s")
    print(f"{'run':<24} {'global':>6} {'FID-digits':>22} {'cond. acc. %':>20} {'IS-digits':>20} {'CAS %':>20} "
          f"{'train s':>8}")
    for row in table:
        cells = []
        for score, scale in zip(SCORES, (1, 100, 1, 100)):
            s = row.get(score)
            cells.append(f"{s['median'] * scale:6.2f} [{s['min'] * scale:.2f}, {s['max'] * scale:.2f}]" if s else "-")
        print(f"{row['label']:<24} {row['global_batch']:>6} {cells[0]:>22} {cells[1]:>20} {cells[2]:>20} "
              f"{cells[3]:>20} {row['train_seconds']:>8.1f}")
    floor = table[0].get("fid_digits_real_vs_real")
    if floor:
        print(f"real vs real FID-digits (the floor): {floor['median']:.2f}")


def plot(table: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep_rows = [row for row in table if row["accumulate"] == 1]
    batches = [row["global_batch"] for row in sweep_rows]
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for axis, score, title in zip(axes, ("fid_digits", "conditional_accuracy"),
                                  ("FID-digits (lower is better)", "conditional accuracy")):
        medians = [row[score]["median"] for row in sweep_rows]
        low = [row[score]["median"] - row[score]["min"] for row in sweep_rows]
        high = [row[score]["max"] - row[score]["median"] for row in sweep_rows]
        axis.errorbar(batches, medians, yerr=[low, high], marker="o", capsize=3, label="cross-replica BN")
        for row in table:
            if row["accumulate"] > 1:
                s = row[score]
                axis.errorbar([row["global_batch"]], [s["median"]], fmt="s", color="tab:red", capsize=3,
                              yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]], label=row["label"])
        axis.set_xscale("log", base=2)
        axis.set_xticks(batches, [str(b) for b in batches])
        axis.set_xlabel("global batch")
        axis.set_title(title)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.sweep:
        sweep(args)
    else:
        train(args)


if __name__ == "__main__":
    main(sys.argv[1:])

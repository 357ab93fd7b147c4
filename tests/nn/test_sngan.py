"""examples/sngan.py: 2 replicas with b each train its generator and discriminator as 1 process with 2b does
(conditional cross-replica batch norm, spectral norm, two optimizers); its scores are right on known inputs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import replicator as rp
from replicator.testing import run_replicas

from _numerics import assert_within, bound, gamma

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PER_REPLICA = 4
N_DIS = 2
STEPS = 3
Z_DIM = 8


def load(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # sngan imports sngan_eval from its own directory
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _reals(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Real digits of every step and discriminator update: (STEPS, N_DIS, global batch, 1, 8, 8), and classes."""
    generator = torch.Generator().manual_seed(7)
    images = torch.tanh(2 * torch.randn(STEPS, N_DIS, 2 * PER_REPLICA, 1, 8, 8, generator=generator, dtype=dtype))
    return images, torch.randint(0, 10, (STEPS, N_DIS, 2 * PER_REPLICA), generator=generator)


def _trained(dtype: torch.dtype, repl: rp.Replicator, example: ModuleType) -> dict[str, Any]:
    """STEPS generator steps of the example's step_fn, then one more forward of each network (train mode)."""
    torch.manual_seed(0)
    with repl.scope():
        generator = example.Generator(z_dim=Z_DIM, width=4, image_size=8).to(dtype)
        discriminator = example.Discriminator(width=4, image_size=8).to(dtype)
        g_optimizer = repl.wrap_optimizer(torch.optim.Adam(generator.parameters(), lr=0.01, betas=(0.0, 0.9)))
        d_optimizer = repl.wrap_optimizer(torch.optim.Adam(discriminator.parameters(), lr=0.02, betas=(0.0, 0.9)))
    initial = {"G": generator.linear.weight.detach().clone(), "D": discriminator.embed.weight.detach().clone()}
    noise = example.GlobalNoise(Z_DIM, seed=3, replica=repl.replica_id, replicas=repl.num_replicas)
    share = 2 * PER_REPLICA // repl.num_replicas
    rows = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
    images, labels = _reals(dtype)
    # Each discriminator update's global batch, this replica's rows of it: what one process would see joined.
    batches = [(images[step, :, rows].reshape(-1, 1, 8, 8), labels[step, :, rows].reshape(-1)) for step in range(STEPS)]
    step_fn = example.make_step(repl, generator, discriminator, g_optimizer, d_optimizer, noise, N_DIS)
    start = repl.global_step
    losses = [loss for _, loss in repl.run(step_fn, batches, steps=start + STEPS, progress=False)]
    grads = {f"G.{n}": p.grad.clone() for n, p in generator.named_parameters() if p.grad is not None}
    grads |= {f"D.{n}": p.grad.clone() for n, p in discriminator.named_parameters() if p.grad is not None}

    def forward(ctx: rp.ReplicaContext, _: Any) -> dict[str, torch.Tensor]:
        z, classes = noise(share, dtype)
        fakes = generator(z, classes)
        return {"fakes": ctx.all_gather(fakes.detach()),
                "scores": ctx.all_gather(discriminator(fakes, classes).detach())}

    (_, outputs), = list(repl.run(forward, [0], steps=start + STEPS + 1, progress=False))
    state = {f"G.{k}": v.clone() for k, v in generator.state_dict().items()}
    state |= {f"D.{k}": v.clone() for k, v in discriminator.state_dict().items()}
    moved = {"G": float((generator.linear.weight.detach() - initial["G"]).abs().max()),
             "D": float((discriminator.embed.weight.detach() - initial["D"]).abs().max())}
    return {"losses": torch.stack(losses), "grads": grads, "state": state, "moved": moved, **outputs}


def train_both_precisions() -> dict[str, dict[str, Any]]:
    example = load("sngan")
    repl = rp.Replicator()
    return {str(dtype): _trained(dtype, repl, example) for dtype in (torch.float64, torch.float32)}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.numerics  # convolutions and norms over 4 images against 8
@pytest.mark.timeout(240)
def test_two_replicas_train_generator_and_discriminator_as_one_process_with_the_whole_batch() -> None:
    (one,) = run_replicas(train_both_precisions, 1)
    two = run_replicas(train_both_precisions, 2)
    # Relative to each compared tensor's largest element: one process and the 2 replicas add the same terms in
    # other orders and through other kernels. The longest sum in an update is a convolution's weight gradient over
    # the global batch's 8 images x 8 x 8 positions, after a fan-in of 3 x 3 x 16, and the norms' statistics over
    # the batch; STEPS x (N_DIS + 1) updates carry it on (7.1e-4 in float32, 1.3e-12 in float64; seen here: 2e-6
    # and 2e-15).
    length = 2 * PER_REPLICA * 8 * 8 + 3 * 3 * 16 + 2 * PER_REPLICA
    for dtype, tolerance in ((name, 2 * gamma(length, getattr(torch, name.split(".")[1])) * STEPS * (N_DIS + 1))
                             for name in ("torch.float64", "torch.float32")):
        expected = one[dtype]
        names = set(expected["state"])
        # Conditional batch norm's running statistics and embeddings, spectral norm's buffers: all compared.
        assert {"G.blocks.0.norm.norm.running_var", "G.norm.gain.weight",
                "D.body.0.parametrizations.weight.0._u", "D.embed.parametrizations.weight.0._v"} <= names
        assert set(expected["grads"]) >= {"G.linear.weight", "G.norm.bias.weight",
                                          "D.linear.parametrizations.weight.original"}
        for replica, got in enumerate(result[dtype] for result in two):
            where = f"{dtype}, replica {replica}"
            assert _relative(got["losses"], expected["losses"]) <= tolerance, (where, got["losses"], expected["losses"])
            assert _relative(got["fakes"], expected["fakes"]) <= tolerance, where
            assert _relative(got["scores"], expected["scores"]) <= tolerance, where
            for name in names:
                relative = _relative(got["state"][name].double(), expected["state"][name].double())
                assert relative <= tolerance, (where, name, relative)
            assert got["grads"].keys() == expected["grads"].keys()
            for name in expected["grads"]:
                assert _relative(got["grads"][name], expected["grads"][name]) <= tolerance, (where, name)
        assert min(expected["moved"].values()) > 1e-3, expected["moved"]  # both networks trained


# -- the scores, on inputs whose answers are known -------------------------------------------------------------


def test_frechet_distance_is_zero_between_identical_sets_and_exact_for_known_shifts_and_scales() -> None:
    metrics = load("sngan_eval")
    features = torch.randn(500, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # float64 throughout: covariances of 500 rows (gamma_500 = 5.6e-14 relative), a 6 x 6 matrix square root and
    # traces of about 6 each: errors of order 1e-12, which these bounds leave four orders of magnitude to.
    assert metrics.frechet_distance(features, features) == pytest.approx(0, abs=1e-8)
    shift = torch.arange(6, dtype=torch.float64)
    assert metrics.frechet_distance(features + shift, features) == pytest.approx(float(shift.square().sum()), rel=1e-9)
    # b = 2a: |mu|^2 + tr(C) + 4 tr(C) - 2 tr((4 C^2)^1/2) = |mu|^2 + tr(C)
    expected = float(features.mean(0).square().sum() + torch.cov(features.T).trace())
    assert metrics.frechet_distance(2 * features, features) == pytest.approx(expected, rel=1e-9)


def test_inception_score_is_one_for_a_single_class_and_the_class_count_for_confident_balanced_sets() -> None:
    metrics = load("sngan_eval")
    one_class = torch.nn.functional.one_hot(torch.full((40,), 3), 10).double()
    balanced = torch.nn.functional.one_hot(torch.arange(40) % 10, 10).double()
    unsure = torch.full((40, 10), 0.1, dtype=torch.float64)
    assert metrics.inception_score(one_class) == pytest.approx(1.0)
    assert metrics.inception_score(unsure) == pytest.approx(1.0)
    assert metrics.inception_score(balanced) == pytest.approx(10.0)
    assert metrics.conditional_accuracy(balanced, torch.arange(40) % 10) == 1.0
    assert metrics.conditional_accuracy(balanced, (torch.arange(40) + 1) % 10) == 0.0


@pytest.mark.timeout(120)
def test_scores_of_real_digits_and_of_a_one_class_set(tmp_path: Path) -> None:
    """Through the classifier: held-out digits score as real digits should, one class alone scores lowest."""
    example, metrics = load("sngan"), load("sngan_eval")
    train, held_out = example.load_digits(8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small convolutions: threads that wait on each other under load only cost
    try:
        _score_real_and_one_class(metrics, train, held_out, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _score_real_and_one_class(metrics: ModuleType, train: tuple[torch.Tensor, torch.Tensor],
                              held_out: tuple[torch.Tensor, torch.Tensor], tmp_path: Path) -> None:
    classifier, accuracy = metrics.cached_classifier(str(tmp_path), 8, train, held_out, epochs=4)  # fast, not best
    assert accuracy > 0.85
    assert metrics.cached_classifier(str(tmp_path), 8, train, held_out)[1] == accuracy  # read back, not retrained
    images, labels = held_out
    real = metrics.scores(classifier, images, labels, held_out, 8, cas=False)
    assert real["fid_digits"] == pytest.approx(0, abs=1e-6) and real["conditional_accuracy"] == accuracy
    assert real["inception_score"] > 3  # a 4-epoch classifier is not confident enough for ~10
    threes = images[labels == 3]
    one_class = metrics.scores(classifier, threes, torch.full((len(threes),), 3), held_out, 8, cas=False)
    assert one_class["inception_score"] < 1.5 < real["inception_score"]
    assert one_class["fid_digits"] > 10 * metrics.frechet_distance(
        metrics.classify(classifier, train[0][: len(images)])[0], metrics.classify(classifier, images)[0])
    metrics.save_grid(images[:20], str(tmp_path / "grid.png"), rows=2)
    assert (tmp_path / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_conditional_batch_norm_is_batch_norm_then_each_class_gain_and_bias() -> None:
    torch.manual_seed(0)
    norm = rp.nn.CrossReplicaConditionalBatchNorm(3, num_classes=4).double()
    with torch.no_grad():
        norm.gain.weight.uniform_(0.5, 2)
        norm.bias.weight.uniform_(-1, 1)
    x, labels = torch.randn(6, 3, 2, 2, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 3, 1])
    plain = torch.nn.functional.batch_norm(x, None, None, training=True)
    expected = plain * norm.gain.weight[labels].view(6, 3, 1, 1) + norm.bias.weight[labels].view(6, 3, 1, 1)
    # Another formula for the same float64 values: batch statistics over 6 x 2 x 2 = 24 values, the normalization,
    # then a gain and a bias: at most 24 + 6 roundings of |normalized x gain| + |bias|.
    gain, shift = norm.gain.weight[labels].view(6, 3, 1, 1), norm.bias.weight[labels].view(6, 3, 1, 1)
    magnitude = (plain * gain).abs() + shift.abs()
    assert_within(norm(x, labels).detach(), expected.detach(), bound(torch.float64, magnitude.detach(), 24 + 6), "norm")
    with pytest.raises(ValueError, match="labels must be 6 integer class indices"):
        norm(x, labels[:5])
    with pytest.raises(ValueError, match="expected 3 channels"):
        norm(x[:, :2], labels)

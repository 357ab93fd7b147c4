"""N replicas with batch B/N each end with the same parameters as one process with batch B."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_replicas

from _numerics import assert_within, bound, training_bound

GLOBAL_BATCH = 16
STEPS = 3
# The longest sum behind one gradient element in a step: the batch's 16 samples (in 2 or 4 shards, or micro-steps,
# on the replicas), then the widest fan-in of the backward (16), plus the optimizer's few roundings.
LENGTH = GLOBAL_BATCH + 16 + 4
CASES = ["sgd", "adam", "accumulate", "unused", "frozen", "batchnorm", "clip_schedule", "torch_clip", "gan",
         "two_backwards", "accumulate_two_backwards", "reentrant"]


class WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.never_used = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class SharedInCheckpoints(torch.nn.Module):
    """One layer run twice, each time inside a reentrant checkpoint: every segment is a backward
    pass of its own that adds into the shared weight's gradient, and ends before the outer one."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(6, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.stem(x))
        for _ in range(2):
            h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.head(h)


def make_model(case: str) -> torch.nn.Module:
    if case == "unused":
        return WithUnused()
    if case == "reentrant":
        return SharedInCheckpoints()
    if case == "batchnorm":
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 3))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    if case == "frozen":
        model[0].requires_grad_(False)  # a frozen backbone: never sent, never updated
    return model


def make_optimizer(case: str, params) -> torch.optim.Optimizer:
    if case in ("adam", "unused"):
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=generator), torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


def gan_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    discriminator = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return generator, discriminator


def gan_step(generator, discriminator, g_opt, d_opt, real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    d_opt.zero_grad()
    d_loss = F.binary_cross_entropy_with_logits(discriminator(real), ones) + F.binary_cross_entropy_with_logits(
        discriminator(generator(noise).detach()), zeros
    )
    d_loss.backward()
    d_opt.step()
    g_opt.zero_grad()
    g_loss = F.binary_cross_entropy_with_logits(discriminator(generator(noise)), ones)
    g_loss.backward()  # also reaches D's parameters: averaged too, then discarded at D's zero_grad
    g_opt.step()
    return g_loss.detach()


def backward_in_halves(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Two backward passes into gradients kept from the last step (zeroed, not freed)."""
    half = x.shape[0] // 2
    (0.5 * F.cross_entropy(model(x[:half]), y[:half])).backward()
    (0.5 * F.cross_entropy(model(x[half:]), y[half:])).backward()


def state_of(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for m in modules for t in m.state_dict().values() if t.is_floating_point()]


def reference(case: str) -> list[torch.Tensor]:
    """One process, the whole batch each step."""
    torch.manual_seed(0)
    if case == "gan":
        generator, discriminator = gan_models()
        g_opt = torch.optim.Adam(generator.parameters(), lr=0.01)
        d_opt = torch.optim.SGD(discriminator.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            x, _ = global_batch(step)
            gan_step(generator, discriminator, g_opt, d_opt, x, x[:, :4] * 0.5)
        return state_of(generator, discriminator)
    model = make_model(case)
    optimizer = make_optimizer(case, model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(STEPS):
        x, y = global_batch(step)
        if case in ("two_backwards", "accumulate_two_backwards"):
            optimizer.zero_grad(set_to_none=False)
            backward_in_halves(model, x, y)
            optimizer.step()
            continue
        optimizer.zero_grad(set_to_none=case != "reentrant")
        F.cross_entropy(model(x), y).backward()
        if case in ("clip_schedule", "torch_clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        if case == "clip_schedule":
            scheduler.step()
    return state_of(model)


def replicated(case: str) -> list[torch.Tensor]:
    """Run inside a replica process: the same training through replicator."""
    repl = rp.Replicator()
    # accumulate_two_backwards: the last micro-step's second backward adds to averages already divided by
    # the micro-steps (it used to divide them twice: 0.11 apart from one process after 4 steps).
    micro_steps = 2 if case in ("accumulate", "accumulate_two_backwards") else 1
    with repl.scope():
        # Different seeds per replica: scope() must still give everyone replica 0's start.
        torch.manual_seed(0 if repl.replica_id == 0 else 1234 + repl.replica_id)
        if case == "gan":
            generator, discriminator = gan_models()
            g_opt = repl.wrap_optimizer(torch.optim.Adam(generator.parameters(), lr=0.01))
            d_opt = repl.wrap_optimizer(torch.optim.SGD(discriminator.parameters(), lr=0.1, momentum=0.9))
        else:
            model = make_model(case)
            if case == "batchnorm":
                model = rp.nn.convert_batchnorm(model)
            optimizer = repl.wrap_optimizer(make_optimizer(case, model.parameters()))
            scheduler = repl.wrap_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    repl.accumulate(micro_steps)

    def input_fn(ctx: rp.InputContext):
        share = ctx.per_replica_batch_size(GLOBAL_BATCH)
        micro = share // micro_steps
        for step in range(STEPS):
            x, y = global_batch(step)
            mine = slice(ctx.input_pipeline_id * share, (ctx.input_pipeline_id + 1) * share)
            for m in range(micro_steps):
                part = slice(m * micro, (m + 1) * micro)
                yield x[mine][part], y[mine][part]

    def step_fn(ctx: rp.ReplicaContext, batch):
        x, y = batch
        if case == "gan":
            return ctx.all_mean(gan_step(generator, discriminator, g_opt, d_opt, x, x[:, :4] * 0.5))
        if case in ("two_backwards", "accumulate_two_backwards"):
            optimizer.zero_grad(set_to_none=False)
            backward_in_halves(model, x, y)
            optimizer.step()
            return None
        optimizer.zero_grad(set_to_none=case != "reentrant")  # reentrant: .grad stays the bucket's view
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if case == "clip_schedule":
            repl.clip_grad_norm_(model.parameters(), 0.05)
        if case == "torch_clip":  # the single-device code, unchanged: backward() left the averages in .grad
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        if case == "clip_schedule":
            scheduler.step()
        return ctx.all_mean(loss.detach())

    steps = [step for step, _ in repl.run(step_fn, repl.prepare_input(input_fn))]
    assert len(steps) == STEPS * micro_steps
    return state_of(generator, discriminator) if case == "gan" else state_of(model)


def all_cases() -> dict[str, list[torch.Tensor]]:
    return {case: replicated(case) for case in CASES}


@pytest.mark.numerics  # shards of 8 or 4 rows against 16: other GEMM kernels
@pytest.mark.parametrize("replicas", [2, 4])
def test_replicas_match_single_process(replicas: int) -> None:
    results = run_replicas(all_cases, replicas, timeout_s=240)
    for case in CASES:
        expected = reference(case)
        tolerance = training_bound(torch.float32, expected, LENGTH, STEPS)
        for replica, result in enumerate(results):
            got = result[case]
            assert len(got) == len(expected)
            for index, (g, e) in enumerate(zip(got, expected)):
                assert_within(g, e, tolerance, f"{case}: replica {replica} tensor {index}")


def test_training_changes_parameters() -> None:
    """Guards the test above against a vacuous pass: the reference really trains."""
    torch.manual_seed(0)
    initial = state_of(make_model("sgd"))
    trained = reference("sgd")
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(initial, trained))


def plain_batchnorm_running_statistics() -> dict[str, list[torch.Tensor]]:
    """Ordinary BatchNorm on 3 replicas: what each tracks alone, what run() and save() leave."""
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(0)
        model = make_model("batchnorm")  # plain BatchNorm1d: statistics of this replica's shard only
        # Buffers equal on every replica must come back bit for bit, even where a sum of three
        # would round (thirds) or overflow (half precision).
        model.register_buffer("thirds", torch.linspace(-3, 3, 1000) / 3)
        model.register_buffer("large_half", torch.full((4,), -30000.0, dtype=torch.float16))
        optimizer = repl.wrap_optimizer(make_optimizer("sgd", model.parameters()))
    norm = model[1]
    local: list[torch.Tensor] = []

    def step_fn(ctx: rp.ReplicaContext, batch):
        x, y = batch
        optimizer.zero_grad()
        F.cross_entropy(model(x + ctx.replica_id), y).backward()  # shards that differ in mean
        optimizer.step()
        local[:] = [norm.running_mean.clone(), norm.running_var.clone(), norm.num_batches_tracked.clone()]

    batches = [global_batch(step) for step in range(STEPS)]
    list(repl.run(step_fn, batches))
    before_run_ended = list(local)
    after_run = [norm.running_mean.clone(), norm.running_var.clone(), norm.num_batches_tracked.clone()]
    step_fn(repl.context, batches[0])  # one more step outside run(): statistics drift apart again
    drifted = [norm.running_mean.clone(), norm.running_var.clone()]
    repl.sync_buffers()
    return {"local": before_run_ended, "after_run": after_run, "drifted": drifted,
            "synced": [norm.running_mean.clone(), norm.running_var.clone()],
            "constant": [model.thirds.clone(), model.large_half.clone()]}


def test_plain_batchnorm_statistics_are_averaged_over_replicas() -> None:
    results = run_replicas(plain_batchnorm_running_statistics, 3, timeout_s=120)
    for key, drifted_key in (("local", "after_run"), ("drifted", "synced")):
        per_replica = [r[key] for r in results]
        assert not torch.allclose(per_replica[0][0], per_replica[1][0]), "the shards must give different statistics"
        for index in range(2):  # running mean, running variance
            stacked = torch.stack([p[index] for p in per_replica])
            expected = stacked.mean(0)
            # The library sums the 3 replicas' buffers in its own order and divides: 3 terms and a division.
            tolerance = bound(torch.float32, stacked.abs().sum(0) / 3, 3 + 1)
            for replica, result in enumerate(results):
                got = result[drifted_key][index]
                assert_within(got, expected, tolerance, f"{drifted_key}: replica {replica} buffer {index}")
                assert torch.equal(got, results[0][drifted_key][index]), "every replica must hold the same bits"
    assert all(int(r["after_run"][2]) == STEPS for r in results), "num_batches_tracked stays a count, not a mean"
    for result in results:
        thirds, large_half = result["constant"]
        assert torch.equal(thirds, torch.linspace(-3, 3, 1000) / 3), "an equal buffer changed in averaging"
        assert torch.equal(large_half, torch.full((4,), -30000.0, dtype=torch.float16)), "an equal fp16 buffer changed"

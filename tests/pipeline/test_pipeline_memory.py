"""A stage holds only its own layers after the cut, and a model built on the meta device materializes per stage."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

GLOBAL_BATCH, STEPS, LR, BALANCE = 16, 3, 0.05, [2, 3]


def model_layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)  # every process builds the same whole model
    return [torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)]


def stage_layers(stage: int) -> range:
    start = sum(BALANCE[:stage])
    return range(start, start + BALANCE[stage])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 6, generator=generator), torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


def replica_batches(ctx: rp.InputContext):
    share = ctx.per_replica_batch_size(GLOBAL_BATCH)
    for step in range(STEPS):
        x, y = batch(step)
        mine = slice(ctx.replica_id * share, (ctx.replica_id + 1) * share)
        yield x[mine], y[mine]


def train(repl: rp.Replicator, pipe, optimizer: torch.optim.Optimizer) -> None:
    def step_fn(ctx: rp.ReplicaContext, data):
        optimizer.zero_grad()
        loss = pipe.train_step(data[0], data[1], F.cross_entropy)
        optimizer.step()
        return ctx.all_mean(loss)

    for _ in repl.run(step_fn, repl.prepare_input(replica_batches), progress=False):
        pass


def live_parameters() -> list[torch.nn.Parameter]:
    """Every parameter with values that this process still holds, whoever holds it."""
    gc.collect()
    return [t for t in gc.get_objects() if isinstance(t, torch.nn.Parameter) and not t.is_meta]


def what_a_stage_holds() -> dict[str, object]:
    repl = rp.Replicator(stages=2, chunks=2)
    with repl.scope():
        layers = model_layers()
        watched = [[weakref.ref(p) for p in layer.parameters()] for layer in layers]
        pipe = repl.pipeline(layers, balance=BALANCE)
        del layers  # the user's own reference to the whole model; the library must hold none
        optimizer = repl.wrap_optimizer(torch.optim.Adam(pipe.parameters(), lr=LR))
    train(repl, pipe, optimizer)
    params = live_parameters()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "stage": repl.stage_id,
        "alive": [i for i, refs in enumerate(watched) if any(ref() is not None for ref in refs)],
        "parameter_bytes": sum(p.nbytes for p in params),
        "gradient_bytes": sum(p.grad.nbytes for p in params if p.grad is not None),
        "optimizer_bytes": sum(t.nbytes for t in state if t.dim() > 0),  # Adam's moments; its step counts are scalars
        "stage_bytes": sum(p.nbytes for p in pipe.parameters()),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_a_stage_holds_only_its_own_parameters_gradients_and_optimizer_state(world: int) -> None:
    whole = model_layers()
    for held in run_replicas(what_a_stage_holds, world, timeout_s=180):
        stage = held["stage"]
        own = sum(p.nbytes for i in stage_layers(stage) for p in whole[i].parameters())
        with_parameters = [i for i in stage_layers(stage) if list(whole[i].parameters())]
        assert held["alive"] == with_parameters  # the other stage's parameters were freed
        assert held["stage_bytes"] == own
        assert held["parameter_bytes"] == own  # nothing else in the process holds a parameter
        assert held["gradient_bytes"] == own
        assert held["optimizer_bytes"] == 2 * own  # exp_avg and exp_avg_sq


def meta_stage(chunks: int) -> tuple[int, list[torch.Tensor], list[torch.Tensor], int, int, torch.Tensor]:
    repl = rp.Replicator(stages=2, chunks=chunks)
    with repl.scope():
        with torch.device("meta"):
            layers = model_layers()  # shapes only: no process ever holds the whole model's values
        pipe = repl.pipeline(layers, balance=BALANCE)
        generator = torch.random.get_rng_state()  # before the scope's end reseeds it per stage
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9))
    start = [p.detach().clone() for p in pipe.parameters()]
    train(repl, pipe, optimizer)
    end = [p.detach().clone() for p in pipe.parameters()]
    others_on_meta = sum(p.is_meta for i, layer in enumerate(layers) if i not in stage_layers(repl.stage_id)
                         for p in layer.parameters())
    return repl.stage_id, start, end, sum(p.nbytes for p in live_parameters()), others_on_meta, generator


def one_process_training() -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    layers = model_layers()
    model = torch.nn.Sequential(*layers)
    start = [[p.detach().clone() for i in stage_layers(s) for p in layers[i].parameters()] for s in range(2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    end = [[p.detach().clone() for i in stage_layers(s) for p in layers[i].parameters()] for s in range(2)]
    return start, end


def test_a_pipeline_built_on_the_meta_device_starts_and_trains_bit_for_bit_as_one_process() -> None:
    # One micro-batch and one replica run the unsplit model's arithmetic, in its order: bit-equality holds.
    start, end = one_process_training()
    model_layers()
    after_a_whole_build = torch.random.get_rng_state()
    for stage, got_start, got_end, live_bytes, others_on_meta, generator in run_replicas(meta_stage, 2, 1,
                                                                                         timeout_s=180):
        assert torch.equal(generator, after_a_whole_build)  # so the stages' dropout streams are a whole build's too
        assert all(torch.equal(g, w) for g, w in zip(got_start, start[stage], strict=True))
        assert all(torch.equal(g, w) for g, w in zip(got_end, end[stage], strict=True))
        assert live_bytes == sum(p.nbytes for p in start[stage])
        assert others_on_meta == sum(1 for i in stage_layers(1 - stage) if i % 2 == 0) * 2  # weight, bias


def test_a_meta_built_pipeline_of_two_replicas_matches_one_process() -> None:
    start, end = one_process_training()
    # Replicas average their halves' gradients and micro-batches sum weighted losses, where one process
    # reduces over the whole batch at once: each gradient entry differs by a few roundings of a sum of
    # GLOBAL_BATCH terms of size <= 1 (softmax minus one-hot, times tanh <= 1, times inputs of a few units).
    gradient_error = 4 * GLOBAL_BATCH * torch.finfo(torch.float32).eps * 8
    tolerance = STEPS * STEPS * LR * gradient_error  # momentum 0.9 carries each step's error into the later ones
    for stage, got_start, got_end, *_ in run_replicas(meta_stage, 4, 2, timeout_s=240):
        assert all(torch.equal(g, w) for g, w in zip(got_start, start[stage], strict=True))
        for got, want in zip(got_end, end[stage], strict=True):
            assert (got - want).abs().max().item() <= tolerance


class Scaled(torch.nn.Module):
    """A layer whose parameter no reset_parameters() sets: it is drawn in __init__."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def scaled_layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(6, 8), Scaled(8), torch.nn.Linear(8, 3)]


def meta_without_init() -> None:
    repl = rp.Replicator(stages=2, chunks=2)
    with repl.scope():
        with torch.device("meta"):
            layers = scaled_layers()
        repl.pipeline(layers, balance=[2, 1])


def test_a_meta_layer_that_reset_parameters_leaves_unset_is_named_on_every_process() -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(meta_without_init, 2, timeout_s=120)
    assert [e.rank for e in caught.value.errors] == [0, 1]
    for error in caught.value.errors:
        assert "layer 1 (Scaled) was built on the meta device, and scale has no values" in error.message
        assert "init=fn" in error.message


def gpt2_init(layer: torch.nn.Module) -> None:
    """What nanoGPT does to every module once the whole model is built (GPT-2's initialisation)."""
    for module in layer.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)


def reinitialised_layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    layers = [torch.nn.Embedding(10, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10)]
    for layer in layers:  # after every layer was built, drawing as it was built: the draws come in two passes
        gpt2_init(layer)
    return layers


def meta_with_init() -> tuple[int, list[torch.Tensor]]:
    repl = rp.Replicator(stages=2, chunks=2)
    with repl.scope():
        with torch.device("meta"):
            layers = reinitialised_layers()  # gpt2_init on meta tensors draws nothing
        pipe = repl.pipeline(layers, balance=[2, 2], init=gpt2_init)
    return repl.stage_id, [p.detach().clone() for p in pipe.parameters()]


def test_init_replays_what_a_model_does_once_built_and_matches_a_whole_build() -> None:
    whole = reinitialised_layers()
    for stage, params in run_replicas(meta_with_init, 2, timeout_s=120):
        expected = [p for layer in whole[2 * stage: 2 * stage + 2] for p in layer.parameters()]
        assert all(torch.equal(g, w) for g, w in zip(params, expected, strict=True))


def meta_outside_a_pipeline(wrap: bool) -> None:
    repl = rp.Replicator()
    with repl.scope():
        with torch.device("meta"):
            model = torch.nn.Linear(4, 4)
        if wrap:
            repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize(("wrap", "message"), [
    (False, "Linear.weight is on the meta device (a shape, no values) at the end of repl.scope()"),
    (True, "Linear.weight is on meta but replica 0 runs on cpu (in wrap_optimizer()); a model built on the meta"),
])
def test_a_meta_model_without_a_pipeline_gets_a_clear_error_on_every_replica(wrap: bool, message: str) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(meta_outside_a_pipeline, 2, wrap, timeout_s=120)
    assert [e.rank for e in caught.value.errors] == [0, 1]
    for error in caught.value.errors:
        assert message.replace("replica 0", f"replica {error.rank}") in error.message
        assert "to_empty(device=repl.device)" in error.message


def meta_mistake(mistake: str) -> None:
    repl = rp.Replicator(stages=2, chunks=2)
    with repl.scope():
        with torch.device("meta"):
            layers = model_layers()
        if mistake == "time":
            repl.pipeline(layers, balance="time", sample=torch.zeros(4, 6))
        elif mistake == "half on meta":
            layers[2] = torch.nn.Linear(32, 32)
            repl.pipeline(layers, balance=BALANCE)
        else:  # init= for a model with values
            repl.pipeline(model_layers(), balance=BALANCE, init=gpt2_init)


@pytest.mark.parametrize(("mistake", "message"), [
    ("time", 'balance="time" runs every layer to time it, but the model is on the meta device'),
    ("half on meta", "layers 0, 4 are on the meta device but layer 2 is not: build every layer on the meta device"),
    ("init without meta", "init= initialises layers built on the meta device, and no layer is on it"),
])
def test_what_a_meta_model_cannot_do_is_refused_on_every_process(mistake: str, message: str) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(meta_mistake, 2, mistake, timeout_s=120)
    assert [e.rank for e in caught.value.errors] == [0, 1]
    assert all(message in e.message for e in caught.value.errors)


def meta_interleaved_start() -> tuple[int, list[torch.Tensor], bool]:
    repl = rp.Replicator(stages=2, chunks=2, schedule="interleaved", virtual_stages=2)
    with repl.scope():
        with torch.device("meta"):
            layers = model_layers()
        pipe = repl.pipeline(layers, balance=[1, 1, 1, 2])  # stage 0: pieces 0 and 2; stage 1: pieces 1 and 3
    return repl.stage_id, [p.detach().clone() for p in pipe.parameters()], layers[4 - 2 * repl.stage_id].weight.is_meta


def test_virtual_stages_materialize_each_of_their_pieces_with_a_whole_builds_values() -> None:
    whole = model_layers()
    pieces = {0: [0, 2], 1: [4]}  # the layers with parameters in each stage's pieces
    for stage, params, other_on_meta in run_replicas(meta_interleaved_start, 2, timeout_s=120):
        expected = [p for i in pieces[stage] for p in whole[i].parameters()]
        assert all(torch.equal(g, w) for g, w in zip(params, expected, strict=True))
        assert other_on_meta  # stage 0 never gives layer 4 values, nor stage 1 layer 2

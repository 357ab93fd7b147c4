"""The run record: what every repl.run() leaves in runs/<time>-<name>, written once, by the main process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

GLOBAL_BATCH = 32
STEPS = 6


def read_metrics(directory: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(directory) / "metrics.jsonl").read_text().splitlines()]


def read_json(directory: str | Path, name: str) -> dict[str, Any]:
    return json.loads((Path(directory) / name).read_text())


def quickstart(steps: int, second_run_steps: int = 0, hide_tensorboard: bool = False) -> dict[str, Any]:
    """The README quickstart's shape, returning a dict of scalars: what each replica saw."""
    if hide_tensorboard:
        sys.modules["tensorboard"] = None  # type: ignore[assignment]  # as when it is not installed
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def input_fn(ctx: rp.InputContext) -> Any:
        generator = torch.Generator().manual_seed(1)
        dataset = torch.utils.data.TensorDataset(torch.randn(512, 64, generator=generator),
                                                 torch.randint(0, 10, (512,), generator=generator))
        return torch.utils.data.DataLoader(dataset, batch_size=ctx.per_replica_batch_size(GLOBAL_BATCH),
                                           sampler=ctx.sampler(dataset, shuffle=True, seed=0))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> dict[str, Any]:
        images, labels = batch
        logits = model(images)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        accuracy = (logits.argmax(1) == labels).float().mean()
        return {"loss": ctx.all_mean(loss.detach()), "metrics": {"accuracy": accuracy, "replica": ctx.replica_id}}

    outputs = [(step, {"loss": float(out["loss"]), "accuracy": float(out["metrics"]["accuracy"])})
               for step, out in repl.run(step_fn, repl.prepare_input(input_fn), steps=steps, name="quick")]
    result = {"outputs": outputs, "run_dir": repl.last_run["run_dir"], "directory": repl.record.directory,
              "samples_per_second": repl.last_run["samples_per_second"]}
    if second_run_steps:
        for _ in repl.run(step_fn, repl.prepare_input(input_fn), steps=steps + second_run_steps, name="quick"):
            pass
        result["second_run_dir"] = repl.last_run["run_dir"]
    return result


def test_a_two_replica_run_records_each_step_once_with_its_config_and_summary(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    results = run_replicas(quickstart, 2, STEPS, 2, env={"REPLICATOR_RUNS": str(root)}, timeout_s=120)
    main, other = results
    assert other["run_dir"] is None and other["directory"] is None  # only the main process writes
    runs = sorted(root.iterdir())
    assert [Path(main["run_dir"]), Path(main["second_run_dir"])] == runs  # a second run(): a directory of its own
    assert runs[0].name.endswith("-quick") and runs[1].name.endswith(("-quick", "-quick-2"))  # -2: the same second
    metrics = read_metrics(runs[0])
    assert [line["step"] for line in metrics] == list(range(STEPS))
    assert all(line["samples"] == GLOBAL_BATCH for line in metrics)  # the whole job's, counted once
    for line, (step, seen) in zip(metrics, main["outputs"], strict=True):
        assert line["step"] == step and line["loss"] == pytest.approx(seen["loss"], abs=0)  # replica 0's outputs
        assert line["metrics/accuracy"] == pytest.approx(seen["accuracy"], abs=0)
        assert line["metrics/replica"] == 0 and line["samples_per_second"] > 0 and line["time"] > 0
    assert [line["step"] for line in read_metrics(runs[1])] == [STEPS, STEPS + 1]

    config = read_json(runs[0], "config.json")
    assert config["topology"] | {"world_size": 2, "replicas": 2, "stages": 1, "nodes": 1, "mode": "sync"} == \
        config["topology"]
    assert config["arguments"]["reducer"] == "auto" and config["reducer"] == "shm"  # as given, and as it ran
    assert config["bucket_cap_mb"] == 25.0
    assert config["model"]["parameters"] == 64 * 128 + 128 + 128 * 10 + 10
    assert config["model"]["parameter_bytes"] == 4 * config["model"]["parameters"]
    assert config["versions"]["torch"] == torch.__version__ and config["versions"]["replicator"]
    assert config["command"] and config["name"] == "quick"

    summary = read_json(runs[0], "summary.json")
    assert summary["status"] == "finished" and summary["steps"] == STEPS
    assert summary["samples_per_second"] == pytest.approx(main["samples_per_second"])
    assert [entry["replica"] for entry in summary["breakdown"]] == [0, 1]
    assert sum(entry["steps"] + entry["warmup"]["steps"] for entry in summary["breakdown"]) == 2 * STEPS
    assert summary["record"]["steps"] == STEPS and summary["record"]["samples"] == STEPS * GLOBAL_BATCH
    assert summary["record"]["tensorboard"] is True
    assert list(runs[0].glob("events.out.tfevents.*"))  # TensorBoard's, as it is installed here
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(runs[0]))
    board.Reload()
    scalars = {tag: board.Scalars(tag) for tag in board.Tags()["scalars"]}
    assert sorted(scalars) == ["loss", "metrics/accuracy", "metrics/replica", "replicator/samples_per_second"]
    for tag, events in scalars.items():  # every step of every scalar, as metrics.jsonl has them (float32)
        assert [event.step for event in events] == list(range(STEPS))
        column = "samples_per_second" if tag.startswith("replicator/") else tag
        assert [event.value for event in events] == \
            [pytest.approx(line[column], rel=torch.finfo(torch.float32).eps) for line in metrics]


def test_without_tensorboard_the_record_has_everything_else(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    (result,) = run_replicas(quickstart, 1, 3, 0, True, env={"REPLICATOR_RUNS": str(root)}, timeout_s=90)
    directory = Path(result["run_dir"])
    assert not list(directory.glob("events.out.tfevents.*"))
    assert [line["step"] for line in read_metrics(directory)] == [0, 1, 2]
    assert read_json(directory, "summary.json")["record"]["tensorboard"] is False


def recorded_variants(root: str) -> dict[str, Any]:
    """record=False, REPLICATOR_RUNS=0, a path given twice (a resumed training appends), a crash and a break."""
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> torch.Tensor:
        if ctx.step == 11 and batch.shape[0] == 3:
            raise RuntimeError("a bad batch")
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    data = [torch.randn(2, 3)] * 10
    seen: dict[str, Any] = {}
    for _ in repl.run(step_fn, data, steps=2, record=False):
        pass
    seen["off"] = (repl.last_run["run_dir"], repl.record.directory)
    os.environ["REPLICATOR_RUNS"] = "0"
    for _ in repl.run(step_fn, data, steps=4):
        pass
    seen["env_off"] = repl.last_run["run_dir"]
    os.environ["REPLICATOR_RUNS"] = root
    path = Path(root) / "fixed"
    for _ in repl.run(step_fn, data, steps=6, record=path):
        pass
    for _ in repl.run(step_fn, data, steps=8, record=str(path)):
        pass
    seen["fixed"] = repl.last_run["run_dir"]
    try:
        for _ in repl.run(step_fn, [torch.randn(3, 3)] * 10, steps=12, name="crash"):
            pass
    except RuntimeError:
        seen["crashed"] = str(repl.record.directory)
    seen["stopped_at"] = repl.global_step + 2
    for step, _ in repl.run(step_fn, data, steps=30, name="stopped"):
        if step == seen["stopped_at"]:
            break
    seen["stopped"] = str(repl.record.directory)
    return seen


def test_records_can_be_turned_off_named_appended_to_and_survive_errors(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    (seen,) = run_replicas(recorded_variants, 1, str(root), timeout_s=90)
    assert seen["off"] == (None, None) and seen["env_off"] is None
    fixed = read_metrics(seen["fixed"])
    assert [line["step"] for line in fixed] == list(range(4, 8))  # steps 4-5, then 6-7 appended
    assert read_json(seen["fixed"], "summary.json")["steps"] == 8
    crashed = read_json(seen["crashed"], "summary.json")
    assert crashed["status"] == "failed" and "RuntimeError: a bad batch" in crashed["error"]
    assert [line["step"] for line in read_metrics(seen["crashed"])] == [8, 9, 10]  # the steps before the error
    stopped = read_json(seen["stopped"], "summary.json")
    assert stopped["status"] == "stopped" and stopped["record"]["last_step"] == seen["stopped_at"]
    assert {path.name.split("-", 2)[-1] for path in root.iterdir()} == {"fixed", "crash", "stopped"}


def bad_record(record: Any, name: Any) -> None:
    repl = rp.Replicator()
    for _ in repl.run(lambda ctx, batch: ctx.all_mean(batch.sum()), [torch.ones(2)] * 2, record=record, name=name):
        pass


@pytest.mark.parametrize(("record", "name", "says"), [(3, None, "run(record=3) must be True"),
                                                      (True, "a/b", "run(name='a/b') must be a non-empty string")])
def test_a_bad_record_or_name_raises_on_every_replica(run_failing_fast: Any, record: Any, name: Any,
                                                      says: str) -> None:
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(bad_record, 2, record, name)
    assert [error.rank for error in failure.value.errors] == [0, 1]
    assert all(error.kind == "ReplicatorUsageError" and says in error.message for error in failure.value.errors)


def pipeline_run(root: str) -> dict[str, Any]:
    repl = rp.Replicator(stages=2, chunks=2)
    with repl.scope():
        torch.manual_seed(0)
        pipe = repl.pipeline([torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)], balance=[2, 1])
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = pipe.train_step(batch[0], batch[1], F.mse_loss)  # the last stage's loss, on every stage
        optimizer.step()
        return ctx.all_mean(loss)

    generator = torch.Generator().manual_seed(repl.replica_id)
    data = [(torch.randn(4, 4, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(3)]
    losses = [float(loss) for _, loss in repl.run(step_fn, data, record=Path(root) / "pipe")]
    return {"losses": losses, "stage": repl.stage_id, "run_dir": repl.last_run["run_dir"]}


def test_a_pipeline_run_records_the_last_stages_loss_and_counts_each_replica_once(tmp_path: Path) -> None:
    results = run_replicas(pipeline_run, 4, str(tmp_path), timeout_s=150)  # 2 replicas x 2 stages
    metrics = read_metrics(tmp_path / "pipe")
    assert [line["step"] for line in metrics] == [0, 1, 2]
    assert all(line["samples"] == 2 * 4 for line in metrics)  # 2 replicas of 4, not once per stage as well
    assert [line["loss"] for line in metrics] == pytest.approx(results[0]["losses"], abs=0)
    assert results[0]["losses"] == results[1]["losses"]  # stage 1 computed it; stage 0 returned it
    config = read_json(tmp_path / "pipe", "config.json")
    assert (config["topology"]["stages"], config["topology"]["replicas"]) == (2, 2)
    assert config["model"]["parameters"] == 4 * 8 + 8  # stage 0's share, and says so
    assert config["model"]["of"].startswith("stage 0")
    assert [r["run_dir"] is not None for r in results] == [True, False, False, False]


def async_run(root: str) -> dict[str, Any]:
    repl = rp.Replicator(mode="async", parameter_servers=1, sync_group_size=1, max_staleness=2)
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        loss = F.mse_loss(model(batch[0]), batch[1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    data = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(4)]
    losses = [float(loss) for _, loss in repl.run(step_fn, data, steps=4, record=Path(root) / "async")]
    return {"losses": losses, "run_dir": repl.last_run.get("run_dir")}


def test_an_async_run_records_its_main_workers_steps_and_every_groups_staleness(tmp_path: Path) -> None:
    results = run_replicas(async_run, 3, str(tmp_path), timeout_s=150)  # groups 0 and 1, then a server
    metrics = read_metrics(tmp_path / "async")
    assert [line["step"] for line in metrics] == [0, 1, 2, 3]
    assert all(line["samples"] == 4 for line in metrics)  # group 0's batch: its sync group's steps
    assert [line["loss"] for line in metrics] == pytest.approx(results[0]["losses"], abs=0)
    summary = read_json(tmp_path / "async", "summary.json")
    groups = summary["asynchronous"]["groups"]
    assert set(groups) == {"0", "1"} and all(group["staleness"]["bound"] == 2 for group in groups.values())
    assert read_json(tmp_path / "async", "config.json")["topology"]["servers"] == 1
    assert read_json(tmp_path / "async", "config.json")["topology"]["serving_role"] == "parameter server"
    assert results[1]["run_dir"] is None and results[2]["run_dir"] is None

"""run(timeline=...): one Chrome trace with a track per process, the expected spans, nested; nothing when off."""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas
from replicator.timeline import Span, span
from replicator.timeline.trace import lanes

STEPS = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(replica: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(replica)
    return [(torch.randn(4, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator))
            for _ in range(steps)]


def hooks_on(module: torch.nn.Module) -> int:
    return sum(len(hooks) for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                                        module._backward_pre_hooks))


def load(path: str) -> dict[str, Any]:
    """Strict JSON, as Perfetto and chrome://tracing read it: NaN or Infinity would fail here."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in the trace")

    with open(path, encoding="utf-8") as file:
        return json.load(file, parse_constant=refuse)


def complete(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def of_rank(trace: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """Rank `rank`'s spans: its process's pid is rank + 1 (Perfetto takes pid 0 for the kernel's idle task)."""
    return [e for e in complete(trace) if e["pid"] == rank + 1]


def check_tracks(trace: dict[str, Any], processes: int) -> dict[int, str]:
    """One named process per rank, every thread with events named; returns the process names by rank."""
    metadata = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    names = {e["pid"] - 1: e["args"]["name"] for e in metadata if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]) for e in metadata if e["name"] == "thread_name"}
    assert sorted(names) == list(range(processes)), names
    assert {(e["pid"], e["tid"]) for e in complete(trace)} <= threads
    assert all(e["pid"] > 0 and e["tid"] > 0 for e in complete(trace))
    return names


def check_nested(trace: dict[str, Any]) -> None:
    """Non-negative spans, and on every thread any two are disjoint or one holds the other (what X events need)."""
    slack = 0.01  # microseconds: the file rounds to nanoseconds
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in complete(trace):
        assert event["ts"] >= 0 and event["dur"] >= 0, event
        by_thread[(event["pid"], event["tid"])].append(event)
    for thread, events in by_thread.items():
        open_ends: list[float] = []
        for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= event["ts"] + slack:
                open_ends.pop()
            end = event["ts"] + event["dur"]
            assert not open_ends or end <= open_ends[-1] + slack, f"{event} overlaps its parent on thread {thread}"
            open_ends.append(end)


def inside(event: dict[str, Any], spans: list[dict[str, Any]]) -> bool:
    return any(s["ts"] - 0.01 <= event["ts"] and event["ts"] + event["dur"] <= s["ts"] + s["dur"] + 0.01
               for s in spans)


# -- a synchronous run: on, off, and through the environment ------------------------------------------


def sync_worker(directory: str) -> dict[str, Any]:
    repl = rp.Replicator(bucket_cap_mb=1e-6)  # a bucket per parameter: four buckets in flight per step
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    hooks_in_steps: list[int] = []
    failing = False

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        hooks_in_steps.append(hooks_on(model))
        if failing:
            raise ValueError("a step that fails on every replica")
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with span("log the loss", "user"):  # a user's own span, on the same track
            return ctx.all_mean(loss.detach())

    # steps= counts the whole training's steps: each run goes STEPS further.
    list(repl.run(step_fn, batches(repl.replica_id, STEPS), steps=STEPS, timeline=False))
    hooks_off, hooks_in_steps[:] = list(hooks_in_steps), []
    path = os.path.join(directory, "trace.json")
    list(repl.run(step_fn, batches(repl.replica_id, STEPS), steps=2 * STEPS, timeline=path,
                  checkpoint_every=STEPS, checkpoint_dir=os.path.join(directory, "checkpoints")))
    hooks_on_, hooks_after, written = list(hooks_in_steps), hooks_on(model), repl.last_run.get("timeline")
    # REPLICATOR_TIMELINE=1, and a loop left by a break: the steps so far are the timeline.
    os.makedirs(os.path.join(directory, "env"), exist_ok=True)
    os.chdir(os.path.join(directory, "env"))
    os.environ["REPLICATOR_TIMELINE"] = "1"
    for _ in repl.run(step_fn, batches(repl.replica_id, STEPS), steps=3 * STEPS, record=False):
        break
    # Unnamed, with the run recorded: the trace is the record's timeline.json.
    list(repl.run(step_fn, batches(repl.replica_id, STEPS), steps=3 * STEPS, record=os.path.join(directory, "rec")))
    in_record = repl.last_run.get("timeline")
    del os.environ["REPLICATOR_TIMELINE"]
    # A run that fails: each process writes its own spans beside the trace.
    failing, raised = True, ""
    try:
        list(repl.run(step_fn, batches(repl.replica_id, STEPS), steps=4 * STEPS,
                      timeline=os.path.join(directory, "failed.json")))
    except ValueError as error:
        raised = str(error)
    return {"hooks_off": hooks_off, "hooks_on": hooks_on_, "hooks_after": hooks_after,
            "written": written, "path": path, "raised": raised, "in_record": in_record}


def test_a_two_replica_run_leaves_one_trace_of_every_process(tmp_path: Any) -> None:
    results = run_replicas(sync_worker, 2, str(tmp_path), timeout_s=180)
    # Off: no hooks at all; on: hooks while the run records, none left after it.
    for result in results:
        assert result["hooks_off"] == [0] * STEPS
        assert all(count > 0 for count in result["hooks_on"]) and result["hooks_after"] == 0
    assert not glob.glob(str(tmp_path / "timeline-*.json"))  # timeline=False wrote nothing
    trace = load(results[0]["path"])
    names = check_tracks(trace, 2)
    assert names == {0: "rank 0: replica 0", 1: "rank 1: replica 1"}
    check_nested(trace)
    for rank in (0, 1):
        mine = of_rank(trace, rank)
        by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for event in mine:
            by_name[event["name"]].append(event)
        assert [e["args"]["step"] for e in by_name["step"]] == [3, 4, 5]
        # checkpoint_every=3: one save, between step 5 and the end of the run.
        assert [e["args"]["step"] for e in by_name["checkpoint save"]] == [6]
        assert by_name["checkpoint save"][0]["ts"] >= by_name["step"][-1]["ts"] + by_name["step"][-1]["dur"]
        for name in ("forward", "backward", "optimizer step", "gradient wait", "agreement wait", "log the loss"):
            assert len(by_name[name]) == STEPS, (rank, name, len(by_name[name]))
            assert all(inside(e, by_name["step"]) for e in by_name[name]), name
        assert len(by_name["input wait"]) == STEPS  # the first batch, then the next one during each step but the last
        # Every bucket's reduction, from its launch during backward to its completion.
        buckets = [e for e in mine if e["cat"] == "communication" and e["name"].startswith("bucket")]
        assert sorted((e["args"]["step"], e["args"]["bucket"]) for e in buckets) == [
            (step, bucket) for step in range(STEPS, 2 * STEPS) for bucket in range(4)]
        assert all(e["name"] == f"bucket {e['args']['bucket']}" and e["args"]["bytes"] > 0 for e in buckets)
        assert all(inside({"ts": e["ts"], "dur": 0}, by_name["backward"]) for e in buckets)
        assert {e["tid"] for e in buckets}.isdisjoint({e["tid"] for e in by_name["step"]})
    assert [r["written"] for r in results] == [results[0]["path"]] * 2
    # REPLICATOR_TIMELINE=1: timeline-<time>.json in the current directory, both processes in it.
    written = glob.glob(str(tmp_path / "env" / "timeline-*.json"))
    assert len(written) == 1
    left_early = load(written[0])
    check_tracks(left_early, 2)
    assert [sum(e["name"] == "step" for e in of_rank(left_early, rank)) for rank in (0, 1)] == [1, 1]
    recorded = os.path.join(str(tmp_path), "rec", "timeline.json")
    assert results[0]["in_record"] == recorded and check_tracks(load(recorded), 2)
    # The failed run: no merged trace, each process's own.
    assert [r["raised"] for r in results] == ["a step that fails on every replica"] * 2
    assert not (tmp_path / "failed.json").exists()
    for rank in (0, 1):
        partial = load(str(tmp_path / f"failed.rank{rank}.json"))
        assert [p["label"] for p in partial["otherData"]["processes"]] == [f"rank {rank}: replica {rank}"]
        assert {e["pid"] for e in complete(partial)} == {rank + 1} and partial["otherData"]["incomplete"]


# -- pipeline stages, on two (simulated) machines -----------------------------------------------------


def pipeline_worker(path: str) -> dict[str, Any]:
    repl = rp.Replicator(stages=2, chunks=2)
    with repl.scope():
        pipe = repl.pipeline(list(make_model()), balance=[2, 1])
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = pipe.train_step(batch[0], batch[1], F.cross_entropy)
        optimizer.step()
        return loss

    list(repl.run(step_fn, batches(0, STEPS), steps=STEPS, timeline=path))
    return {"stage": repl.stage_id}


def test_a_pipeline_run_shows_every_stage_s_actions(tmp_path: Any) -> None:
    path = str(tmp_path / "pipeline.json")
    # One process per "node": the run measures the clocks' offsets (one machine's clock: applied as zero).
    run_replicas(pipeline_worker, 2, path, timeout_s=180, local_world_size=1)
    trace = load(path)
    names = check_tracks(trace, 2)
    assert names == {0: "rank 0: replica 0, stage 0", 1: "rank 1: replica 0, stage 1"}
    check_nested(trace)
    for rank, sends in ((0, "send act"), (1, "send grad")):
        mine = of_rank(trace, rank)
        steps = [e for e in mine if e["name"] == "step"]
        actions = [e for e in mine if e["cat"] in ("forward", "backward")]
        assert sorted(e["name"] for e in actions) == sorted(["F 0", "F 1", "B 0", "B 1"] * STEPS)
        assert all(inside(e, steps) for e in actions)
        assert sum(e["name"].startswith(sends) for e in mine) == 2 * STEPS
    processes = trace["otherData"]["processes"]
    assert all("measured_clock_offset_us" in p and abs(p["measured_clock_offset_us"]) < 1e6 for p in processes)
    assert [p["clock_offset_us"] for p in processes] == [0.0, 0.0]


def records_on_the_main_process_only() -> None:
    repl = rp.Replicator()
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()

    list(repl.run(step_fn, batches(repl.replica_id, 1), timeline=repl.is_main))


def test_recording_on_some_machines_only_fails_clearly() -> None:
    with pytest.raises(ReplicaFailure) as caught:
        # Two "machines": the clocks are measured together, which needs every process to record.
        run_replicas(records_on_the_main_process_only, 2, timeout_s=90, local_world_size=1,
                     env={"REPLICATOR_TIMEOUT": "4"})
    main = next(e for e in caught.value.errors if e.rank == 0)
    assert "rank(s) [1] did not start recording a timeline" in main.message
    assert "pass the same run(timeline=...)" in main.message


# -- parameter servers --------------------------------------------------------------------------------


def async_worker(path: str) -> str:
    repl = rp.Replicator(mode="async", parameter_servers=1, max_staleness=1)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def input_fn(ctx: rp.InputContext) -> list[Any]:
        return batches(ctx.input_pipeline_id, STEPS)

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        loss = F.cross_entropy(model(batch[0]), batch[1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    list(repl.run(step_fn, repl.prepare_input(input_fn), steps=STEPS, timeline=path))
    return str(repl.last_run.get("timeline"))


def test_an_asynchronous_run_shows_pushes_pulls_and_the_server(tmp_path: Any) -> None:
    path = str(tmp_path / "async.json")
    written = run_replicas(async_worker, 3, path, timeout_s=180)
    assert written[0] == path
    trace = load(path)
    names = check_tracks(trace, 3)
    assert names[2] == "rank 2: parameter server 0" and names[1] == "rank 1: worker 0 of sync group 1"
    check_nested(trace)
    for rank in (0, 1):
        mine = [e["name"] for e in of_rank(trace, rank)]
        assert mine.count("push") == STEPS and mine.count("pull") == 1 and mine.count("finish") == 1
        assert mine.count("wait on servers") == STEPS + 2 and mine.count("optimizer step") == STEPS
    served = of_rank(trace, 2)
    assert [e["name"] for e in served].count("serve push") == 2 * STEPS
    assert [e["name"] for e in served].count("serve pull") == 2
    assert sum(e["name"] == "apply update" for e in served) >= STEPS
    assert inside(next(e for e in served if e["name"] == "apply update"), [e for e in served if e["name"] == "serve"])


# -- DiLoCo and actor-learner ------------------------------------------------------------------------


def diloco_worker(path: str) -> None:
    repl = rp.Replicator(mode="diloco", sync_group_size=1, outer_every=2)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        loss = F.cross_entropy(model(batch[0]), batch[1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    list(repl.run(step_fn, batches(repl.replica_id, 4), steps=4, timeline=path))


def test_a_diloco_run_shows_its_outer_steps(tmp_path: Any) -> None:
    path = str(tmp_path / "diloco.json")
    run_replicas(diloco_worker, 2, path, timeout_s=180)
    trace = load(path)
    check_tracks(trace, 2)
    check_nested(trace)
    for rank in (0, 1):
        mine = of_rank(trace, rank)
        outer = [e for e in mine if e["name"] == "outer step"]
        assert [e["args"]["outer_step"] for e in outer] == [0, 1]
        assert sum(e["name"] == "optimizer step" for e in mine) == 4  # the inner steps, every one local


def toy_actor(actor: rp.ActorContext) -> None:
    t = 0
    while actor.running:
        observation = torch.tensor([t / 10, 0.0])
        actor.add(observation=observation, action=torch.rand(1), reward=float(observation.sum()),
                  next_observation=torch.tensor([(t + 1) / 10, 0.0]), truncated=t == 9)
        t = (t + 1) % 10


def actor_learner_worker(path: str) -> None:
    repl = rp.Replicator(mode="actor_learner", actors=1)
    replay = rp.Replay(capacity=64, batch_size=4, samples_per_insert=None, min_size=8, seed=1)
    with repl.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> torch.Tensor:
        loss = F.mse_loss(model(torch.cat([batch.observation, batch.action], dim=1)).squeeze(1), batch.reward)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    list(repl.run(step_fn, repl.prepare_input(replay), steps=STEPS, actor_fn=toy_actor, update_period=4,
                  timeline=path))


def test_an_actor_learner_run_shows_env_steps_pulls_and_updates(tmp_path: Any) -> None:
    path = str(tmp_path / "actor_learner.json")
    run_replicas(actor_learner_worker, 2, path, timeout_s=180, env={"REPLICATOR_TIMEOUT": "60"})
    trace = load(path)
    assert check_tracks(trace, 2) == {0: "learner 0 (rank 0)", 1: "actor 0 (rank 1)"}
    check_nested(trace)
    learner, actor = of_rank(trace, 0), of_rank(trace, 1)
    assert sum(e["name"] == "optimizer step" for e in learner) == STEPS
    assert any(e["name"] == "serve actor" for e in learner) and any(e["name"] == "publish weights" for e in learner)
    env_steps = [e for e in actor if e["name"] == "env step"]
    pulls = [e for e in actor if e["name"] == "weight pull"]
    assert len(env_steps) >= 8 and len(pulls) >= max(2, len(env_steps) // 4)  # the first, then every 4 env steps
    assert all(inside(e, [a for a in actor if a["name"] == "actor"]) for e in env_steps + pulls)


# -- lanes --------------------------------------------------------------------------------------------


def test_spans_go_to_lanes_where_they_nest_or_where_peers_do_not_overlap() -> None:
    steps = [Span("step", "step", 0.0, 10.0), Span("backward", "backward", 1.0, 5.0),
             Span("optimizer step", "optimizer", 5.0, 6.0), Span("late", "step", 9.0, 11.0)]
    assert [[s.name for s in lane] for lane in lanes(steps)] == [["step", "backward", "optimizer step"], ["late"]]
    buckets = [Span(f"bucket {n}", "communication", start, end)
               for n, (start, end) in enumerate([(2.0, 7.0), (3.0, 6.0), (6.5, 8.0)])]
    assert [[s.name for s in lane] for lane in lanes(buckets, nest=False)] == [["bucket 0"], ["bucket 1", "bucket 2"]]

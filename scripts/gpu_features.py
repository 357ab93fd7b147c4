"""The CUDA code paths of replicator's features, checked on one GPU and written to a JSON file.

Two replicas share the one GPU over Gloo (NCCL refuses two processes on one GPU), so every
collective moves CUDA tensors and every gradient bucket is reduced while backward runs:

- equivalence: 2 replicas (batch 8 each) against one process (batch 16) on the same GPU, with
  CrossReplicaBatchNorm2d against torch's BatchNorm2d, SGD with momentum, 4 steps;
- overlap: the run's timeline, every gradient bucket launched inside its step's backward;
- a compressed reducer (fp16) whose reductions run on the reducer's thread and CUDA stream;
- a checkpoint saved from CUDA replicas and restored by one CPU process, bit for bit;
- `shard="gradients"` (ZeRO-2) on the same replicas, bit for bit with `shard=None`;
- parameter servers: 2 workers training on the GPU and 1 server, bulk synchronous (one sync group,
  staleness 0), against one process on the same GPU;
- the run record written on CUDA and `replicator report` reading it;
- the D4PG example with its learner on CUDA (1 learner, 1 actor, the evaluator).

Command, from the repository root on a machine with a CUDA GPU:

    python scripts/gpu_features.py --json gpu_features.json

`--cpu-dry-run` runs the same checks on CPU (Gloo), only to test the script where no GPU exists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import replicator as rp
from replicator.testing import run_replicas

ROOT = Path(__file__).resolve().parent.parent
STEPS, GLOBAL_BATCH = 4, 16


def _model(batchnorm: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), batchnorm(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=generator), torch.randint(0, 10, (GLOBAL_BATCH,),
             generator=generator)) for _ in range(STEPS)]


def _exact_kernels() -> None:
    # Plain fp32 on both sides: TF32 would round each side's convolutions differently.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def _replicas(directory: str, reducer: str, shard: str | None = None) -> dict[str, Any]:
    """One replica of the 2-replica job: train, time it, checkpoint it; return its parameters on CPU."""
    _exact_kernels()
    repl = rp.Replicator(reducer=reducer, bucket_cap_mb=1e-6, shard=shard)  # a bucket per parameter: several at once
    reducer = reducer if shard is None else f"{reducer}-{shard}"  # the name of this run's files
    with repl.scope():
        model = _model(rp.nn.CrossReplicaBatchNorm2d)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    # scope() builds on the replica's device, with that device's random generator: the reference starts from here.
    initial = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    share = GLOBAL_BATCH // repl.num_replicas
    mine = [(x[repl.replica_id * share:(repl.replica_id + 1) * share].to(repl.device),
             y[repl.replica_id * share:(repl.replica_id + 1) * share].to(repl.device)) for x, y in _data()]

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = F.cross_entropy(model(batch[0]), batch[1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    record = os.path.join(directory, f"record-{reducer}")
    timeline = os.path.join(directory, f"timeline-{reducer}.json")
    losses = [float(loss) for _, loss in repl.run(step_fn, mine, steps=STEPS, record=record, timeline=timeline,
                                                     progress=False, warmup_steps=1)]
    repl.save(os.path.join(directory, f"checkpoint-{reducer}"))
    devices = sorted({str(p.device) for p in model.parameters()})
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
    parameters = {name: p.detach().cpu() for name, p in model.state_dict().items()}
    repl.close()
    return {"parameters": parameters, "initial": initial, "losses": losses, "devices": devices, "backend": backend}


def _one_process(device: torch.device, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    _exact_kernels()
    model = _model(nn.BatchNorm2d)
    model.load_state_dict(initial)
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for images, labels in _data():
        loss = F.cross_entropy(model(images.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {name: p.detach().cpu() for name, p in model.state_dict().items()}


def _bound(reference: dict[str, torch.Tensor]) -> float:
    # fp32 rounding over 4 steps of a batch-16 conv net: a few hundred ulps of the largest value,
    # as the per-replica partial sums (8 + 8 samples) round apart from one sum of 16.
    largest = max(float(t.abs().max()) for t in reference.values() if t.is_floating_point())
    return 512 * torch.finfo(torch.float32).eps * max(largest, 1.0)


def _worst(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(float((ours[name].double() - reference[name].double()).abs().max())
               for name in reference if reference[name].is_floating_point())


def _buckets_inside_backward(trace_path: str) -> tuple[int, int]:
    """(buckets launched inside their step's backward, buckets) over the trace's steps after the first."""
    events = json.loads(Path(trace_path).read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    inside, total = 0, 0
    for pid in {e.get("pid") for e in events if e.get("ph") == "X"}:
        mine = [e for e in events if e.get("pid") == pid and e.get("ph") == "X"]
        backwards = [e for e in mine if e["name"] == "backward"]
        for bucket in (e for e in mine if e["cat"] == "communication" and e["name"].startswith("bucket")):
            total += 1
            inside += any(b["ts"] <= bucket["ts"] <= b["ts"] + b["dur"] for b in backwards)
    return inside, total


def check_replicas(directory: str, device_env: dict[str, str], reducer: str,
                   trained: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Train on 2 replicas; compare with one process; leave replica 0's parameters in `trained`."""
    results = run_replicas(_replicas, 2, directory, reducer, env=device_env, timeout_s=300)
    trained.update(results[0]["parameters"])
    device = torch.device("cuda" if device_env["REPLICATOR_DEVICE"] == "cuda" else "cpu")
    reference = _one_process(device, results[0]["initial"])
    worst, bound = _worst(results[0]["parameters"], reference), _bound(reference)
    same = all(torch.equal(results[0]["parameters"][k], results[1]["parameters"][k]) for k in reference)
    inside, buckets = _buckets_inside_backward(os.path.join(directory, f"timeline-{reducer}.json"))
    figures = {"devices": results[0]["devices"], "backend": results[0]["backend"], "losses": results[0]["losses"],
               "max |replicas - one process|": worst, "bound": bound, "replicas bit-identical": same,
               "buckets launched inside backward": f"{inside} of {buckets}"}
    # A compressed reducer sums fp16 copies of the gradients: its bound is fp16's, not fp32's.
    close = worst <= (bound if reducer != "fp16" else 64 * torch.finfo(torch.float16).eps)
    figures["ok"] = bool(close and same and buckets > 0 and inside == buckets
                         and results[0]["devices"] == [str(device) if device.type == "cpu" else "cuda:0"])
    return figures


def check_sharded(directory: str, device_env: dict[str, str], trained: dict[str, torch.Tensor]) -> dict[str, Any]:
    """ZeRO-2 on the replicas that trained `trained` unsharded: the same parameters, bit for bit."""
    results = run_replicas(_replicas, 2, directory, "flat", "gradients", env=device_env, timeout_s=300)
    equal = all(torch.equal(results[0]["parameters"][name], trained[name]) for name in trained)
    same = all(torch.equal(results[0]["parameters"][k], results[1]["parameters"][k]) for k in trained)
    return {"devices": results[0]["devices"], "bit-identical to shard=None": equal, "replicas bit-identical": same,
            "ok": bool(equal and same)}


def _worker_batch(worker: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(8, 5, generator=generator).to(device), torch.randn(8, 2, generator=generator).to(device)


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 2))


def _parameter_server_job() -> dict[str, Any]:
    """One process of a 3-process job: 2 workers (on the job's device) and 1 server, one sync group, staleness 0."""
    _exact_kernels()
    repl = rp.Replicator(mode=rp.ParameterServers(servers=1, sync_group_size=2, max_staleness=0))
    with repl.scope():
        model = _small_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    initial = [p.detach().cpu().clone() for p in model.parameters()]  # built with the device's generator

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        optimizer.zero_grad()
        F.mse_loss(model(batch[0]), batch[1]).backward()
        optimizer.step()

    batches = repl.prepare_input(lambda ctx: [_worker_batch(ctx.input_pipeline_id, step, repl.device)
                                              for step in range(STEPS)])
    for _ in repl.run(step_fn, batches, steps=STEPS, progress=False):
        pass
    devices = sorted({str(p.device) for p in model.parameters()})
    figures = {"parameters": [p.detach().cpu() for p in model.parameters()], "initial": initial, "devices": devices,
               "serves": bool(repl.regime.serves), "run": repl.last_run.get("asynchronous")}
    repl.close()
    return figures


def check_parameter_servers(device: torch.device, device_env: dict[str, str]) -> dict[str, Any]:
    results = run_replicas(_parameter_server_job, 3, env=device_env, timeout_s=300)
    _exact_kernels()
    model = _small_model().to(device)
    server = next(r for r in results if r["serves"])
    with torch.no_grad():  # the server's initial values, which the workers pull (built with the device's generator)
        for param, value in zip(model.parameters(), server["initial"], strict=True):
            param.copy_(value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        parts = [_worker_batch(worker, step, device) for worker in range(2)]
        optimizer.zero_grad()
        F.mse_loss(model(torch.cat([x for x, _ in parts])), torch.cat([y for _, y in parts])).backward()
        optimizer.step()
    reference = {str(n): p.detach().cpu() for n, p in enumerate(model.parameters())}
    workers = [r for r in results if not r["serves"]]
    worst = max(_worst({str(n): p for n, p in enumerate(r["parameters"])}, reference) for r in results)
    bound = _bound(reference)
    return {"workers' devices": [r["devices"] for r in workers], "transport": workers[0]["run"].get("transport"),
            "max |job - one process|": worst, "bound": bound,
            "ok": bool(worst <= bound and len(workers) == 2
                       and all(r["devices"] == [str(device) if device.type == "cpu" else "cuda:0"] for r in workers))}


def _restore_on_cpu(path: str) -> dict[str, torch.Tensor]:
    repl = rp.Replicator()
    with repl.scope():
        model = _model(rp.nn.CrossReplicaBatchNorm2d)
        repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    restored = repl.restore(path)
    assert restored.step == STEPS, restored.step
    state = {name: p.detach().clone() for name, p in model.state_dict().items()}
    devices = {str(p.device) for p in model.parameters()}
    repl.close()
    assert devices == {"cpu"}, devices
    return state


def check_checkpoint(directory: str, trained: dict[str, torch.Tensor]) -> dict[str, Any]:
    restored = run_replicas(_restore_on_cpu, 1, os.path.join(directory, "checkpoint-flat"),
                            env={"REPLICATOR_DEVICE": "cpu"})[0]
    equal = all(torch.equal(restored[name], trained[name]) for name in trained)
    return {"restored on": "cpu", "bit-identical to the trained replicas": equal, "ok": equal}


def check_report(directory: str) -> dict[str, Any]:
    record = Path(directory, "record-flat")  # run(record=PATH) writes the record there
    config = json.loads((record / "config.json").read_text())["topology"]
    report = subprocess.run([sys.executable, "-m", "replicator.cli", "report", str(record)], capture_output=True,
                            text=True, timeout=120, cwd=directory)
    pictures = sorted(p.name for p in Path(directory).rglob("*.png"))
    return {"record device": config.get("device"), "record backend": config.get("backend"),
            "report exit code": report.returncode, "report tail": report.stdout[-600:] + report.stderr[-600:],
            "pictures": pictures, "ok": report.returncode == 0}


def check_d4pg(directory: str, device: str) -> dict[str, Any]:
    command = [sys.executable, str(ROOT / "examples" / "d4pg.py"), "--actors", "1", "--learners", "1", "--steps",
               "60", "--min-replay", "200", "--batch-size", "64", "--samples-per-insert", "32", "--update-period",
               "20", "--eval-every", "200", "--eval-episodes", "2", "--hidden", "32", "--out", directory]
    env = {**os.environ, "REPLICATOR_PROGRESS": "0", "REPLICATOR_TIMEOUT": "60", "REPLICATOR_DEVICE": device,
           "REPLICATOR_RUNS": os.path.join(directory, "runs")}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    output = done.stdout + done.stderr
    curve = Path(directory, "curve.json")
    figures: dict[str, Any] = {"exit code": done.returncode, "seconds": round(time.perf_counter() - started, 1),
                               "output tail": output[-1500:]}
    if curve.exists():
        figures["actor_learner"] = json.loads(curve.read_text()).get("actor_learner")
    figures["ok"] = done.returncode == 0 and curve.exists()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="gpu_features.json", help="where the figures go")
    parser.add_argument("--trace", help="also copy the flat reducer's timeline (Chrome trace) here")
    parser.add_argument("--cpu-dry-run", action="store_true", help="no GPU: run the same checks on CPU")
    options = parser.parse_args(argv)
    if not options.cpu_dry_run and not torch.cuda.is_available():
        print(f"gpu_features: skipped, CUDA is not available (torch {torch.__version__}); nothing was checked.")
        return 0
    device = "cpu" if options.cpu_dry_run else "cuda"
    device_env = {"REPLICATOR_DEVICE": device, "REPLICATOR_BACKEND": "gloo"}
    results: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)
                               if device == "cuda" else "CPU (dry run)"}
    trained: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as directory:
        checks: dict[str, Callable[[], dict[str, Any]]] = {
            "2 replicas on one GPU, flat reducer": lambda: check_replicas(directory, device_env, "flat", trained),
            "checkpoint from CUDA restored on CPU": lambda: check_checkpoint(directory, trained),
            "2 replicas on one GPU, shard='gradients'": lambda: check_sharded(directory, device_env, trained),
            "2 replicas on one GPU, fp16 reducer": lambda: check_replicas(directory, device_env, "fp16", {}),
            "run record and report": lambda: check_report(directory),
            "parameter servers, workers on the GPU": lambda: check_parameter_servers(torch.device(device),
                                                                                      device_env),
            "D4PG, learner on the GPU": lambda: check_d4pg(os.path.join(directory, "d4pg"), device),
        }
        for name, check in checks.items():
            started = time.perf_counter()
            try:
                results[name] = check()
            except Exception as error:  # one failing path must not hide the others
                results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}",
                                 "traceback": traceback.format_exc()[-3000:]}
            results[name]["check seconds"] = round(time.perf_counter() - started, 1)
            brief = {k: v for k, v in results[name].items() if k not in ("traceback", "output tail", "report tail")}
            print(f"{'ok  ' if results[name]['ok'] else 'FAIL'} {name}: {brief}", flush=True)
        if options.trace and Path(directory, "timeline-flat.json").exists():
            shutil.copyfile(Path(directory, "timeline-flat.json"), options.trace)
    Path(options.json).write_text(json.dumps(results, indent=1, default=str))
    failed = [name for name, figures in results.items() if isinstance(figures, dict) and not figures["ok"]]
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

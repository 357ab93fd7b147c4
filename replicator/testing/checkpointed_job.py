"""A small checkpointed training job for recovery tests: resumes from its directory and can kill itself on cue."""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import replicator as rp
from replicator import _env, checkpoint
from replicator.checkpoint.files import STEP_NAME
from replicator.launch.recovery import current_attempt

__all__ = ["main", "GLOBAL_BATCH", "SAMPLES", "JobResult", "launch_job", "recovery_problems"]

GLOBAL_BATCH = 32
SAMPLES = 256  # 8 steps per epoch: a run of 20 steps crosses two epoch boundaries


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True, help="checkpoint directory (resumes from its latest checkpoint)")
    parser.add_argument("--out", required=True, help="where rank 0 writes the final parameters (torch.save of tensors)")
    parser.add_argument("--log", default=None, help="rank 0 appends 'attempt step port' after every completed step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=-1, help="on attempt 0, SIGKILL --kill-rank before this step")
    parser.add_argument("--kill-save", type=int, default=-1,
                        help="on attempt 0, SIGKILL --kill-rank while saving this step")
    parser.add_argument("--kill-rank", type=int, default=1)
    return parser.parse_args(argv)


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    options = _arguments(argv)
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4)
        )
        optimizer = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
        scheduler = repl.wrap_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7))
    data = torch.Generator().manual_seed(1)
    features, labels = torch.randn(SAMPLES, 8, generator=data), torch.randint(0, 4, (SAMPLES,), generator=data)
    dataset = torch.utils.data.TensorDataset(features, labels)
    sampler: torch.utils.data.DistributedSampler[tuple[torch.Tensor, ...]] = torch.utils.data.DistributedSampler(
        dataset, num_replicas=repl.num_replicas, rank=repl.replica_id, shuffle=True, seed=0, drop_last=True
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH // repl.num_replicas, sampler=sampler)
    layout = checkpoint.Layout(repl.replica_id, repl.num_replicas)
    objects: dict[str, Any] = dict(modules=model, optimizers=[optimizer], schedulers=[scheduler], layout=layout,
                                   group=repl.groups.control)

    # Each replica draws its own dropout masks and input noise (torch, Python and NumPy
    # generators), so a resumed run matches only if every replica's streams come back.
    torch.manual_seed(100 + repl.replica_id)
    random.seed(200 + repl.replica_id)
    np.random.seed(300 + repl.replica_id)
    attempt = current_attempt()
    step, epoch, skip = 0, 0, 0
    resume_rng: torch.Tensor | None = None
    last = checkpoint.latest(options.dir)
    if last is not None:
        restored = checkpoint.restore(last, **objects)
        step, epoch, skip = restored.step, restored.input_state["epoch"], restored.input_state["batches"]
        resume_rng = restored.input_state.get("epoch_rng")
    if options.kill_save >= 0 and attempt == 0 and repl.topology.rank == options.kill_rank:
        checkpoint._after_write = lambda path: _die() if step == options.kill_save else None

    log = open(options.log, "a") if options.log and repl.is_main else None
    while step < options.steps:
        sampler.set_epoch(epoch)
        epoch_rng = torch.get_rng_state()
        if resume_rng is not None:
            # Re-create the interrupted epoch as it began (a DataLoader draws from the global
            # generator when iterated), skip what was consumed, then continue the saved stream.
            now, epoch_rng = torch.get_rng_state(), resume_rng
            torch.set_rng_state(resume_rng)
            batches = iter(loader)
            for _ in range(skip):
                next(batches)
            torch.set_rng_state(now)
            resume_rng = None
        else:
            batches, skip = iter(loader), 0
        for index, (x, y) in enumerate(batches, start=skip):
            if step >= options.steps:
                break
            if step == options.kill_step and attempt == 0 and repl.topology.rank == options.kill_rank:
                _die()
            x = x + 0.01 * random.gauss(0.0, 1.0) + 0.01 * float(np.random.randn())
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if log is not None:
                log.write(f"{attempt} {step} {os.environ.get('MASTER_PORT', '-')}\n")
                log.flush()
            if step % options.every == 0:
                checkpoint.save(checkpoint.step_path(options.dir, step), **objects, step=step, keep=options.keep,
                                input_state={"epoch": epoch, "batches": index + 1, "epoch_rng": epoch_rng})
        epoch, skip = epoch + 1, 0
    if repl.is_main:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(options.out))
    return 0


@dataclass
class JobResult:
    """What a launched job left behind: exit code, output, final parameters and its step log."""

    returncode: int
    output: str
    params: dict[str, torch.Tensor] | None
    steps: list[tuple[int, int, str]] = field(default_factory=list)  # (attempt, completed step, rendezvous port)
    directory: Path = Path()


def launch_job(
    workdir: Path, *job_args: str, replicas: int = 2, max_restarts: int = 0, timeout_s: float = 300.0
) -> JobResult:
    """Run this job under `replicator launch` in `workdir` (one thread per replica)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out, log, directory = workdir / "params.pt", workdir / "steps.log", workdir / "checkpoints"
    command = [
        sys.executable, "-m", "replicator.cli", "launch", "-n", str(replicas), "--threads", "1",
        "--max-restarts", str(max_restarts), "-m", __name__,
        "--dir", str(directory), "--out", str(out), "--log", str(log), *job_args,
    ]
    # Nothing from an enclosing job's rendezvous may leak into this one.
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    # TMPDIR: the launcher keeps a failed attempt's log in a temporary directory, here in workdir.
    env.update({_env.PROGRESS: "0", "PYTHONUNBUFFERED": "1", "TMPDIR": str(workdir)})
    env.setdefault(_env.DEVICE, "cpu")  # as run_replicas: several processes, one machine, maybe one GPU
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        output, _ = launcher.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun's agent then stops its workers, which live in sessions of
        # their own and would outlive a SIGKILLed launcher.
        launcher.terminate()
        try:
            output, _ = launcher.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            launcher.kill()
            output, _ = launcher.communicate()
        output += f"\n(launcher stopped after {timeout_s:.0f} s: a hang)"
    params = torch.load(out, weights_only=True) if out.exists() else None
    steps = []
    if log.exists():
        for line in log.read_text().split("\n"):
            if line.strip():
                attempt, step, port = line.split()
                steps.append((int(attempt), int(step), port))
    return JobResult(launcher.returncode, output, params, steps, directory)


def recovery_problems(result: JobResult, reference: dict[str, torch.Tensor], *, steps: int, every: int) -> list[str]:
    """Why a killed-and-restarted job does not count as recovered ([] when it does)."""
    if result.returncode != 0:
        return [f"exit code {result.returncode}:\n{result.output[-3000:]}"]
    problems = []
    if result.params is None or result.params.keys() != reference.keys():
        return ["no final parameters"]
    different = [k for k in reference if not torch.equal(result.params[k], reference[k])]
    if different:
        problems.append(f"final parameters differ from the uninterrupted run's: {different}")
    attempts = sorted({attempt for attempt, _, _ in result.steps})
    if attempts != [0, 1]:
        problems.append(f"expected attempts [0, 1], the log shows {attempts}")
        return problems
    first = [step for attempt, step, _ in result.steps if attempt == 0]
    second = [step for attempt, step, _ in result.steps if attempt == 1]
    resumed = second[0] - 1
    redone = (max(first) if first else 0) - resumed
    if resumed % every or redone > every or redone < 0:
        problems.append(f"resumed after step {resumed}, redoing {redone} steps (a checkpoint every {every})")
    if second != list(range(resumed + 1, steps + 1)):
        problems.append(f"attempt 1 ran steps {second}")
    ports = {attempt: port for attempt, _, port in result.steps}
    if ports[0] == ports[1]:
        problems.append(f"both attempts used rendezvous port {ports[0]}")
    leftovers = sorted(p.name for p in result.directory.iterdir() if not STEP_NAME.match(p.name))
    last_saved = checkpoint.step_path(result.directory, steps - steps % every)
    if leftovers or checkpoint.latest(result.directory) != last_saved:
        problems.append(f"checkpoint directory holds {sorted(p.name for p in result.directory.iterdir())}")
    return problems


if __name__ == "__main__":
    sys.exit(main())

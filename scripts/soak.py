"""Soak test: 4 replicas, thousands of small steps, replicas jostled out of step by random delays.

Runs `replicator launch -n 4` on this script's worker mode. Every replica trains the same
tiny model with `repl.run`, averaging gradients and reducing its loss each step; each one
sleeps a random 0..--max-delay-ms in some steps (before the forward pass, inside backward
while gradient buckets are in flight, or before the loss reduction),
and now and then stalls for 0.5-1 s, with a different random stream per replica, so that
replicas reach every collective out of step. Every replica samples its resident memory
(/proc/self/statm) along the way.

It passes when, on every replica, resident memory grew by less than --max-growth-mib from
10% into the run to its end; the whole launch finished before --deadline (a hang is killed
and reported, never waited on); every replica completed every step; periodic all_gather
checks saw identical parameters mid-run; and the final parameters are bitwise identical
across replicas (compared by the parent from the files the replicas wrote, not through
replicator's own collectives). Exit status 0 on a pass, 1 on a failure.

    .venv/bin/python scripts/soak.py                 # 3000 steps, about a minute or two on 2 cores
    .venv/bin/python scripts/soak.py --steps 10000 --json soak.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPLICAS = 4
GLOBAL_BATCH = 32
SAMPLES = 4096
FEATURES, HIDDEN, CLASSES = 32, 64, 8
MIB = 1 << 20


# -- the worker: one replica -------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Epochs:
    """The shard's DataLoader, epoch after epoch (reshuffled each time), for `steps` batches in all."""

    def __init__(self, loader: Any, sampler: Any, steps: int) -> None:
        self.loader, self.sampler, self.steps = loader, sampler, steps

    def __iter__(self) -> Any:
        served, epoch = 0, 0
        while served < self.steps:
            self.sampler.set_epoch(epoch)
            for batch in self.loader:
                if served == self.steps:
                    return
                served += 1
                yield batch
            epoch += 1


def worker(options: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    import replicator as rp

    out = Path(options.out)
    (out / f"pid{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))  # so a hang can be cleaned up by pid
    torch.set_num_threads(1)
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
        )
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    def input_fn(ctx: rp.InputContext) -> _Epochs:
        data = torch.Generator().manual_seed(1)
        features = torch.randn(SAMPLES, FEATURES, generator=data)
        labels = torch.randint(0, CLASSES, (SAMPLES,), generator=data)
        dataset = torch.utils.data.TensorDataset(features, labels)
        sampler = ctx.sampler(dataset, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_size=ctx.per_replica_batch_size(GLOBAL_BATCH),
                                             sampler=sampler)
        return _Epochs(loader, sampler, options.steps)

    # A different stream per replica: that is what puts them out of step with each other.
    jitter = random.Random(options.seed * 1000 + repl.replica_id)
    delays = {"count": 0, "seconds": 0.0, "max_s": 0.0, "stalls": 0}
    checks = {"count": 0, "mismatches": 0}

    def maybe_sleep(where: str, planned: tuple[str, float] | None) -> None:
        if planned is None or planned[0] != where:
            return
        time.sleep(planned[1])
        delays["count"] += 1
        delays["seconds"] += planned[1]
        delays["max_s"] = max(delays["max_s"], planned[1])

    def checksum() -> torch.Tensor:
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
            return torch.stack([flat.sum(), flat.abs().sum(), (flat * flat).sum()])

    # Registered after wrap_optimizer, so it runs during backward after the synchronizer's own
    # hook for this weight: a replica that sleeps there keeps its peers' buckets in flight.
    plan_now: list[tuple[str, float] | None] = [None]
    model[0].weight.register_post_accumulate_grad_hook(lambda weight: maybe_sleep("in_flight", plan_now[0]))

    hoard: list[bytearray] = []  # --inject-leak: memory kept alive on purpose, to show the check fails

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        if options.inject_leak_kib:
            hoard.append(bytearray(b"x" * (options.inject_leak_kib * 1024)))
        if ctx.step == options.inject_hang_step and ctx.replica_id == ctx.num_replicas - 1:
            time.sleep(10**6)  # --inject-hang-step: this replica never arrives again
        planned: tuple[str, float] | None = None
        if jitter.random() < options.stall_probability:
            planned = (jitter.choice(("before", "in_flight", "reduce")), jitter.uniform(0.5, 1.0))
            delays["stalls"] += 1
        elif jitter.random() < options.delay_probability:
            planned = (jitter.choice(("before", "in_flight", "reduce")),
                       jitter.uniform(0.0, options.max_delay_ms / 1000))
        features, labels = batch
        plan_now[0] = planned
        maybe_sleep("before", planned)
        loss = F.cross_entropy(model(features), labels)
        optimizer.zero_grad()
        loss.backward()  # bucket all-reduces start here, and end before it returns
        optimizer.step()
        maybe_sleep("reduce", planned)
        mean_loss = ctx.all_mean(loss.detach())
        if ctx.step % options.check_every == 0:
            gathered = ctx.all_gather(checksum().unsqueeze(0))
            checks["count"] += 1
            checks["mismatches"] += int(not bool((gathered == gathered[0]).all()))
        return mean_loss

    samples: list[tuple[int, int]] = [(0, _rss_bytes())]
    started = time.monotonic()
    completed, last_loss = 0, float("nan")
    for step, loss in repl.run(step_fn, repl.prepare_input(input_fn), steps=options.steps, progress=False):
        completed = step + 1
        last_loss = float(loss)
        if completed % options.sample_every == 0:
            samples.append((completed, _rss_bytes()))
    seconds = time.monotonic() - started
    samples.append((completed, _rss_bytes()))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).contiguous()
    result = {
        "rank": repl.topology.rank,
        "replica": repl.replica_id,
        "steps": completed,
        "seconds": seconds,
        "final_loss": last_loss,
        "param_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "rss": samples,
        "delays": delays,
        "checks": checks,
    }
    (out / f"rank{repl.topology.rank}.json").write_text(json.dumps(result))
    return 0


# -- the parent: launch, watch the clock, judge -------------------------------------------------
def _memory(rss: list[tuple[int, int]], steps: int) -> dict[str, float]:
    """RSS at 10% into the run, at its end, the most above the 10% figure, and the trend."""
    after_warmup = [(s, b) for s, b in rss if s >= steps // 10]
    base_step, base = after_warmup[0]
    end = rss[-1][1]
    tail = after_warmup
    slope = 0.0
    if len(tail) > 2:  # least-squares MiB per 1000 steps over the last 90%
        xs, ys = [s for s, _ in tail], [b / MIB for _, b in tail]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return {
        "start_mib": rss[0][1] / MIB,
        "at_10pct_mib": base / MIB,
        "at_10pct_step": base_step,
        "end_mib": end / MIB,
        "max_mib": max(b for _, b in rss) / MIB,
        "growth_mib": (end - base) / MIB,
        "max_growth_mib": (max(b for _, b in after_warmup) - base) / MIB,
        "slope_mib_per_1000_steps": slope,
    }


def _stop(launcher: subprocess.Popen, out: Path) -> str:
    """End a hung launch: SIGTERM (torchrun then stops its workers), then SIGKILL what is left, by pid."""
    launcher.terminate()
    try:
        output, _ = launcher.communicate(timeout=30)
        note = ""
    except subprocess.TimeoutExpired:
        launcher.kill()
        output, _ = launcher.communicate()
        note = " (the launcher ignored SIGTERM and was killed)"
    for pid_file in out.glob("pid*"):
        try:
            pid = int(pid_file.read_text())
            with open(f"/proc/{pid}/cmdline", "rb") as handle:  # still our worker, not a reused pid?
                command = handle.read()
            if b"--worker" in command and str(out).encode() in command:
                os.kill(pid, signal.SIGKILL)
                note += f" (killed leftover replica {pid_file.name[3:]})"
        except (OSError, ValueError):
            pass
    return (output or "") + note


def parent(options: argparse.Namespace) -> int:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="replicator-soak-") as scratch:
        out = Path(scratch)
        command = [
            sys.executable, "-m", "replicator.cli", "launch", "-n", str(options.replicas), "--threads", "1",
            str(Path(__file__).resolve()), "--worker", "--out", str(out),
            "--steps", str(options.steps), "--seed", str(options.seed), "--max-delay-ms", str(options.max_delay_ms),
            "--delay-probability", str(options.delay_probability),
            "--stall-probability", str(options.stall_probability),
            "--sample-every", str(options.sample_every), "--check-every", str(options.check_every),
            "--inject-leak-kib", str(options.inject_leak_kib), "--inject-hang-step", str(options.inject_hang_step),
        ]
        rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if k not in rendezvous}
        # A collective stuck longer than this raises, naming the replicas that never arrived.
        env.update(REPLICATOR_PROGRESS="0", PYTHONUNBUFFERED="1", REPLICATOR_TIMEOUT=str(options.collective_timeout))
        started = time.monotonic()
        launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        hung = False
        try:
            output, _ = launcher.communicate(timeout=options.deadline)
        except subprocess.TimeoutExpired:
            hung = True
            output = _stop(launcher, out) + f"\n(stopped after {options.deadline:.0f} s: a hang)"
        wall = time.monotonic() - started
        results = {}
        for rank in range(options.replicas):
            path = out / f"rank{rank}.json"
            if path.exists():
                results[rank] = json.loads(path.read_text())
    load_after = os.getloadavg()

    failures: list[str] = []
    if hung:
        failures.append(f"the launch did not finish within the {options.deadline:.0f} s deadline (a hang)")
    elif launcher.returncode != 0:
        failures.append(f"the launch exited with code {launcher.returncode}")
    missing = [r for r in range(options.replicas) if r not in results]
    if missing:
        failures.append(f"replica(s) {missing} wrote no result")
    per_replica: dict[int, dict[str, Any]] = {}
    for rank, result in sorted(results.items()):
        memory = _memory([tuple(x) for x in result["rss"]], options.steps)
        per_replica[rank] = {**memory, "steps": result["steps"], "seconds": result["seconds"],
                             "delays": result["delays"], "checks": result["checks"],
                             "param_sha256": result["param_sha256"]}
        if result["steps"] != options.steps:
            failures.append(f"replica {rank} completed {result['steps']} of {options.steps} steps")
        if memory["growth_mib"] >= options.max_growth_mib:
            failures.append(f"replica {rank}: RSS grew {memory['growth_mib']:.1f} MiB from step "
                            f"{memory['at_10pct_step']} to the end (limit {options.max_growth_mib} MiB)")
        if result["checks"]["mismatches"]:
            failures.append(f"replica {rank}: {result['checks']['mismatches']} of {result['checks']['count']} mid-run "
                            "checks saw replicas with different parameters")
    digests = {r["param_sha256"] for r in results.values()}
    if len(digests) > 1:
        failures.append(f"final parameters differ between replicas: {sorted(digests)}")

    run_seconds = max((r["seconds"] for r in results.values()), default=float("nan"))
    summary = {
        "passed": not failures,
        "failures": failures,
        "replicas": options.replicas,
        "steps": options.steps,
        "wall_seconds": wall,
        "run_seconds": run_seconds,
        "steps_per_second": options.steps / run_seconds if results else 0.0,
        "max_injected_delay_s": max((r["delays"]["max_s"] for r in results.values()), default=0.0),
        "identical_final_parameters": len(digests) == 1 and not missing,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "settings": {k: v for k, v in vars(options).items() if k not in ("worker", "out", "json")},
        "per_replica": per_replica,
    }
    print(f"soak: {options.replicas} replicas, {options.steps} steps, wall {wall:.1f} s (launch included), "
          f"training loop {run_seconds:.1f} s, {summary['steps_per_second']:.1f} steps/s")
    print(f"  load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
          f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}")
    print(f"  {'rank':>4} {'RSS start':>10} {'@10%':>9} {'end':>9} {'max':>9} {'growth':>8} {'max grow':>9} "
          f"{'MiB/1k st':>9} {'delays':>7} {'stalls':>6} {'max delay':>9} {'checks':>6}")
    for rank, r in per_replica.items():
        print(f"  {rank:>4} {r['start_mib']:>9.1f}M {r['at_10pct_mib']:>8.1f}M {r['end_mib']:>8.1f}M "
              f"{r['max_mib']:>8.1f}M "
              f"{r['growth_mib']:>+7.2f}M {r['max_growth_mib']:>+8.2f}M {r['slope_mib_per_1000_steps']:>+9.3f} "
              f"{r['delays']['count']:>7} {r['delays']['stalls']:>6} {r['delays']['max_s']:>8.3f}s "
              f"{r['checks']['count'] - r['checks']['mismatches']:>3}/{r['checks']['count']:<3}")
    print(f"  final parameters identical on every replica: {summary['identical_final_parameters']}")
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures))
        print("--- launch output (tail) ---\n" + output[-4000:])
    else:
        print(f"PASS (RSS growth limit {options.max_growth_mib} MiB, deadline {options.deadline:.0f} s)")
    if options.json:
        Path(options.json).write_text(json.dumps(summary, indent=1))
    return 0 if not failures else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument("--seed", type=int, default=0, help="replica r draws its delays from seed*1000+r")
    parser.add_argument("--max-delay-ms", type=float, default=10.0, help="ordinary delays are uniform in [0, this]")
    parser.add_argument("--delay-probability", type=float, default=0.5, help="share of steps a replica delays")
    parser.add_argument("--stall-probability", type=float, default=0.002,
                        help="share of steps a replica stalls 0.5-1 s")
    parser.add_argument("--sample-every", type=int, default=25, help="sample RSS every N steps")
    parser.add_argument("--check-every", type=int, default=100, help="all_gather a parameter checksum every N steps")
    parser.add_argument("--max-growth-mib", type=float, default=20.0, help="RSS growth allowed from 10%% in to the end")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds before the launch counts as hung")
    parser.add_argument("--collective-timeout", type=float, default=60.0, help="REPLICATOR_TIMEOUT for the replicas")
    parser.add_argument("--json", default=None, help="also write the summary here")
    parser.add_argument("--inject-leak-kib", type=int, default=0,
                        help="self-check: every replica keeps this many KiB per step alive "
                             "(the memory check must fail)")
    parser.add_argument("--inject-hang-step", type=int, default=-1,
                        help="self-check: the last replica sleeps forever at this step (the run must fail, not hang)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.steps < 10 or options.replicas < 1 or options.sample_every < 1 or options.check_every < 1:
        parser.error("--steps must be >= 10; --replicas, --sample-every and --check-every >= 1")
    return worker(options) if options.worker else parent(options)


if __name__ == "__main__":
    sys.exit(main())

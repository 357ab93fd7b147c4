"""Kill a replica of a checkpointed job at a random step, many times over; count the runs that recover exactly."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from replicator.testing.checkpointed_job import launch_job, recovery_problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--max-restarts", type=int, default=2)
    parser.add_argument("--during-save", type=float, default=0.25,
                        help="share of runs whose replica dies while writing a checkpoint rather than before a step")
    parser.add_argument("--seed", type=int, default=None, help="choose the kills reproducibly")
    options = parser.parse_args(argv)
    seed = options.seed if options.seed is not None else random.randrange(1 << 30)
    chooser = random.Random(seed)
    job = ("--steps", str(options.steps), "--every", str(options.every), "--keep", "2")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kill_stress_") as scratch:
        root = Path(scratch)
        reference = launch_job(root / "reference", *job, replicas=options.replicas)
        if reference.returncode != 0 or reference.params is None:
            print(f"the uninterrupted reference run failed:\n{reference.output[-3000:]}")
            return 2
        print(f"seed {seed}; reference run {time.monotonic() - started:.1f} s", flush=True)
        passed = 0
        for run in range(options.runs):
            rank = chooser.randrange(options.replicas)
            if chooser.random() < options.during_save:
                kill = ("--kill-save", str(options.every * chooser.randrange(1, options.steps // options.every)))
            else:
                kill = ("--kill-step", str(chooser.randrange(1, options.steps)))
            began = time.monotonic()
            result = launch_job(root / f"run{run}", *job, *kill, "--kill-rank", str(rank), replicas=options.replicas,
                                max_restarts=options.max_restarts)
            problems = recovery_problems(result, reference.params, steps=options.steps, every=options.every)
            passed += not problems
            resumed = next((step - 1 for attempt, step, _ in result.steps if attempt == 1), None)
            print(f"run {run:2d}: {kill[0]} {kill[1]:>2} rank {rank}: {'ok  ' if not problems else 'FAIL'} "
                  f"resumed after step {resumed}, {time.monotonic() - began:.1f} s", flush=True)
            for problem in problems:
                print(f"    {problem}", flush=True)
    print(f"passed {passed}/{options.runs} in {time.monotonic() - started:.0f} s (seed {seed})")
    return 0 if passed == options.runs else 1


if __name__ == "__main__":
    sys.exit(main())

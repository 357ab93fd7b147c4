"""`replicator report`: a summary and PNGs from run records, scaling against a 1-replica run, and bad input refused."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.cli import main
from replicator.testing import run_replicas

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def train(record: str, steps: int, threads: int = 1) -> str | None:
    """A tiny quickstart-shaped run at a fixed per-replica batch, recorded into `record`, on `threads` threads."""
    torch.set_num_threads(threads)  # as `replicator launch --threads` does in each replica (run_replicas: 1)
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        loss = F.cross_entropy(model(batch[0]), batch[1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    generator = torch.Generator().manual_seed(repl.replica_id)
    data = [(torch.randn(16, 16, generator=generator), torch.randint(0, 4, (16,), generator=generator))] * steps
    for _ in repl.run(step_fn, data, steps=steps, record=record, warmup_steps=2):
        pass
    return repl.last_run["run_dir"]


def png_size(path: Path) -> tuple[int, int]:
    content = path.read_bytes()
    assert content[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    width, height = struct.unpack(">II", content[16:24])  # the IHDR chunk, first after the signature
    return width, height


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    one = run_replicas(train, 1, str(root / "one"), 30, timeout_s=90)[0]
    two = run_replicas(train, 2, str(root / "two"), 30, timeout_s=90)[0]
    return Path(one), Path(two)


def test_report_summarizes_runs_and_scaling_against_the_planner(two_runs: tuple[Path, Path], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    one, two = two_runs
    out = tmp_path / "plots"
    assert main(["report", str(one), str(two), "--out", str(out)]) == 0  # measures this machine's link
    printed = capsys.readouterr().out
    assert f"{one}  (1 replica, sync" in printed and f"{two}  (2 replicas, sync" in printed
    assert "samples/s after 2 warm-up steps" in printed
    assert "scaling efficiency: " in printed and "of 2 x the 1-replica run's" in printed
    assert "where time went, per step:" in printed and "exposed communication" in printed
    assert "slowest replica: " in printed
    assert "planner, full overlap" in printed and "planner, no overlap" in printed
    # 1 thread per process on both sides: no threads warning (one above 100 % would depend on timing: not asked)
    assert "torch thread(s) per process" not in printed
    names = {"one-loss.png", "one-throughput.png", "one-breakdown.png", "two-loss.png", "two-throughput.png",
             "two-breakdown.png", "scaling.png"}
    assert names <= {path.name for path in out.iterdir()}
    for name in names:
        width, height = png_size(out / name)
        assert width >= 600 and height >= 400 and (out / name).stat().st_size > 15_000, name
    link = json.loads((out / "calibration.json").read_text())
    assert link["alpha"] >= 0 and link["beta"] > 0  # recorded: a later report reuses it

    # Without --out, each run's plots go into its own directory; the scaling plot beside the runs.
    assert main(["report", str(two), str(one), "--no-prediction"]) == 0
    assert {"loss.png", "throughput.png", "breakdown.png"} <= {path.name for path in two.iterdir()}
    assert png_size(two.parent / "scaling.png")[0] >= 600
    assert "planner" not in capsys.readouterr().out


def test_report_refuses_what_is_not_a_finished_run_with_exit_code_2(two_runs: tuple[Path, Path], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    assert main(["report", str(missing)]) == 2
    assert f"replicator report: {missing}: no such directory" in capsys.readouterr().err

    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path} is not a run record (it has no metrics.jsonl and config.json)" in capsys.readouterr().err

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    (empty / "metrics.jsonl").write_text("")
    assert main(["report", str(empty)]) == 2
    assert f"{empty / 'metrics.jsonl'} holds no steps" in capsys.readouterr().err

    running = tmp_path / "running"
    running.mkdir()
    one = two_runs[0]
    for name in ("config.json", "metrics.jsonl"):  # a run still going: no summary.json yet
        (running / name).write_text((one / name).read_text())
    assert main(["report", str(one), str(running)]) == 2
    assert f"{running}: the run is still in progress, or its process was killed" in capsys.readouterr().err


def test_report_flags_a_baseline_with_other_threads_and_says_how_to_make_a_fair_one(
        two_runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one, two = two_runs
    assert json.loads((one / "config.json").read_text())["threads"]["per_process"] == 1
    assert json.loads((one / "config.json").read_text())["threads"]["launcher"] == 1  # run_replicas sets it
    # A 1-replica baseline on 2 threads against the 2-replica run on 1 thread each: issue 28's 227.6 %.
    wide = Path(run_replicas(train, 1, str(tmp_path / "wide"), 30, 2, timeout_s=90,
                             env={"REPLICATOR_THREADS": "2"})[0])
    config = json.loads((wide / "config.json").read_text())
    assert config["threads"]["per_process"] == 2 and config["threads"]["launcher"] == 2
    assert main(["report", str(wide), str(two), "--no-prediction"]) == 0
    printed = capsys.readouterr().out
    assert ("warning: the 1-replica baseline ran 2 torch thread(s) per process, this run 1: each side did other "
            "work per replica, so the efficiency misleads; for a fair baseline, run the 1-replica job with this "
            "run's threads per replica: `replicator launch -n 1 --threads 1 ") in printed, printed
    assert "(doubtful: see the warning above)" in printed


def test_report_flags_an_efficiency_above_100_percent(two_runs: tuple[Path, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    one, two = two_runs
    fast = tmp_path / "fast"
    fast.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        (fast / name).write_text((two / name).read_text())
    summary = json.loads((two / "summary.json").read_text())
    baseline = json.loads((one / "summary.json").read_text())["samples_per_second"]
    summary["samples_per_second"] = 3 * baseline  # 150 % on 2 replicas, threads alike
    (fast / "summary.json").write_text(json.dumps(summary))
    assert main(["report", str(one), str(fast), "--no-prediction"]) == 0
    printed = capsys.readouterr().out
    assert "scaling efficiency: 150.0%" in printed
    assert "warning: an efficiency above 100 % means the baseline was slower per replica" in printed
    assert "`replicator launch -n 1 --threads 1 " in printed


BALLAST_MIB = 256


def train_with_ballast(record: str) -> tuple[str | None, int, int]:
    """`train`, with replica 1 touching BALLAST_MIB more memory before it: (run_dir, peak RSS before and after, KiB)."""
    import resource

    if os.environ["RANK"] == "1":  # run_replicas sets it, as torchrun does
        ballast = torch.ones(BALLAST_MIB * 2**18)  # 4-byte elements, every page written
        del ballast
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run_dir = train(record, steps=4)
    return run_dir, before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_report_shows_each_replicas_peak_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = run_replicas(train_with_ballast, 2, str(tmp_path / "run"), timeout_s=90)
    run_dir = Path(str(results[0][0]))
    peaks = json.loads((run_dir / "summary.json").read_text())["peak_memory"]
    assert [entry["replica"] for entry in peaks] == [0, 1]
    for entry, (_, before_kib, after_kib) in zip(peaks, results, strict=True):
        # Each replica's own peak, read at the end of run(): between its peaks before and after run() (Linux KiB).
        assert 1024 * before_kib <= entry["max_rss_bytes"] <= 1024 * after_kib
        assert entry["cuda_max_allocated_bytes"] is None  # a CPU run
    # Replica 1's ballast shows on its figure alone (half of it: the two processes differ by less than that).
    assert peaks[1]["max_rss_bytes"] - peaks[0]["max_rss_bytes"] > BALLAST_MIB * 2**20 // 2

    assert main(["report", str(run_dir), "--no-prediction"]) == 0
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if "peak memory per replica (resident set)" in line)
    for entry in peaks:
        assert f"replica {entry['replica']} {entry['max_rss_bytes'] / 2**20:,.1f} MiB" in line

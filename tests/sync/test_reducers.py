"""Reducers: hierarchical sums equal a flat all-reduce; compressed ones stay close, keep exact presence, pay debts."""

from __future__ import annotations

import glob
import shutil
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import replicator as rp
from replicator.sync.bucket import Bucket, assign_buckets
from replicator.sync.reducers import FlatReducer, make_reducer, parse_reducer
from replicator.sync.reducers import shm as shared_memory
from replicator.sync.reducers._worker import SummationReducer
from replicator.sync.reducers.compression import CastReducer
from replicator.sync.reducers.hierarchical import HierarchicalSum, level_groups, plan_levels, replicas_per_node
from replicator.sync.reducers.shm import SharedMemorySum
from replicator.testing import run_replicas
from replicator.topology import build_process_groups, discover

from _numerics import assert_within, bound, training_bound

# Lengths that do and do not divide by the shard counts (2, 4), and ones shorter than them.
SIZES = (1, 3, 4, 6, 1001, 4099)
TRAIN_STEPS = 60
TERM_LIMIT = 50.0  # every replica's test gradient element lies in [-50, 50]: a sum of n has sum(|terms|) <= 50 n


def lossless_bound(replicas: int) -> float:
    """Two fp32 sums of the same `replicas` terms in different orders (Gloo's, a hierarchy's, shared memory's)."""
    return float(bound(torch.float32, TERM_LIMIT * replicas, replicas))


# -- names and layouts, in this process ---------------------------------------------------
def test_names_parse() -> None:
    assert parse_reducer("hierarchical:4x2x2").levels == (4, 2, 2)
    spec = parse_reducer("powersgd:2+noef@hierarchical:2x2")
    assert (spec.compressor, spec.rank, spec.error_feedback, spec.levels) == ("powersgd", 2, False, (2, 2))
    assert parse_reducer("powersgd:4").error_feedback and not parse_reducer("fp16").error_feedback
    assert parse_reducer("bf16+ef").error_feedback and parse_reducer("fp16@auto").topology == "auto"


@pytest.mark.parametrize("bad", ["ring", "powersgd", "powersgd:0", "fp16+fast", "hierarchical:2xa", "hierarchical:0x2",
                                 "flat+ef", "fp16@ring", "fp16@shm"])
def test_unknown_names_are_refused_with_the_list(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown reducer .*available: 'flat'"):
        parse_reducer(bad)


def test_levels_follow_nodes_and_stages() -> None:
    assert replicas_per_node([0, 1, 2, 3], local_world_size=2) == 2
    assert replicas_per_node([0, 1, 2, 3], local_world_size=1) == 1
    assert replicas_per_node([1, 3, 5, 7], local_world_size=4) == 2  # stage 1 of 2, 4 processes per node
    with pytest.raises(ValueError, match="same number of replicas"):
        replicas_per_node([0, 3, 6, 9], local_world_size=4)  # 3 stages over nodes of 4: 2, 1, 1 per node
    stages = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert plan_levels(stages, 4, None, "hierarchical") == (2, 2)
    assert plan_levels([list(range(16))], 4, (2, 2, 4), "x") == (2, 2, 4)  # two levels inside a node
    with pytest.raises(ValueError, match="multiply to 8 but this job has 16"):
        plan_levels([list(range(16))], 4, (4, 2), "hierarchical:4x2")
    with pytest.raises(ValueError, match="node boundary"):
        plan_levels([list(range(16))], 4, (8, 2), "hierarchical:8x2")
    members = list(range(8))
    assert level_groups(members, (2, 2, 2), 0) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert level_groups(members, (2, 2, 2), 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert level_groups(members, (2, 2, 2), 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_one_process_gets_the_flat_reducer_and_objects_need_reduce() -> None:
    assert isinstance(make_reducer("powersgd:4"), FlatReducer)

    class TwoArguments:
        name = "mine"

        def reduce(self, buffer: torch.Tensor, group: Any) -> Any:
            return ("called", buffer.numel())

    with pytest.raises(TypeError, match=r"reduce\(buffer, group, bucket\)"):
        make_reducer(TwoArguments())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="reduce"):
        make_reducer(object())  # type: ignore[arg-type]


class _IdenticalReplicas:
    """A stand-in Summation: `size` replicas that all hold this tensor (the sum is size x it)."""

    name = "flat"

    def __init__(self, size: int) -> None:
        self.size = size

    def sum_(self, tensor: torch.Tensor) -> None:
        tensor.mul_(self.size)


@pytest.mark.parametrize("replicas", [4, 512])  # bf16 counts are exact only to 256: then presence travels apart
def test_cast_keeps_presence_exact_and_owes_what_it_rounded(replicas: int) -> None:
    reducer = CastReducer(_IdenticalReplicas(replicas), "bf16", error_feedback=True)
    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))]
    (bucket,) = assign_buckets(params[::-1], 1 << 30, 1 << 30)
    params[0].grad = torch.tensor([1.0, 1 / 3, 1e-3 + 1e-6, -7.01, 300.3])
    bucket.load(0, 1.0)
    bucket.load(1, 1.0)  # params[1] has no gradient: absent
    bucket.write_presence()
    sent = bucket.buffer[:5].clone()
    reducer._reduce(bucket.buffer, bucket)
    assert bucket.params == params and bucket.buffer[bucket.numel :].tolist() == [replicas, 0.0]
    owed = reducer.residual(bucket)
    assert owed is not None and owed.abs().max() > 0
    # Each replica sent bf16(g) and owes g - bf16(g): together exactly replicas x g (a power of 2: the
    # stand-in sum rounds nothing; the rounding of a real sum on the wire is not fed back). Bit for bit: g - bf16(g)
    # keeps g's low bits, so it is exact in fp32, scaling by a power of 2 is exact, and the two addends' exact sum,
    # replicas x g, is an fp32 number, which IEEE addition returns as it is.
    assert torch.equal(bucket.buffer[:5] + replicas * owed[:5], replicas * sent)
    reducer.close()


# -- inside replica processes -----------------------------------------------------------
def _data(seed: int, n: int, integers: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if integers:  # sums of these are exact in fp32 whatever the order of the additions
        return torch.randint(-1000, 1000, (n,), generator=generator).float()
    return torch.randn(n, generator=generator) * 10.0 ** torch.randint(-3, 4, (n,), generator=generator)


def _lossless(groups: Any, specs: list[Any]) -> dict[str, Any]:
    """Every spec against dist.all_reduce on the replica group, several buckets in flight at once."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for spec in specs:
        reducer = make_reducer(spec, groups) if isinstance(spec, str) else spec[1]()
        spec = spec if isinstance(spec, str) else spec[0]
        inputs = [(n, integers, _data(rank * 7919 + n * 2 + integers, n, integers))
                  for n in SIZES for integers in (True, False)]
        buffers = [x.clone() for _, _, x in inputs]
        pending = [reducer.reduce(b, groups.replica) for b in buffers]
        expected = [x.clone() for _, _, x in inputs]
        for e in expected:  # the caller's own collectives go on while the reducer works
            dist.all_reduce(e, group=groups.replica)
        for p in pending:
            p.wait()
        out[spec] = {
            "name": reducer.name,
            "summation": type(getattr(reducer, "summation", reducer)).__name__,
            "results": {(n, integers): (b, e) for (n, integers, _), b, e in zip(inputs, buffers, expected)},
        }
        getattr(reducer, "close", lambda: None)()
    return out


def _bucket(rank: int, step: int, absent: set[int], active: bool = True) -> tuple[Bucket, list[torch.nn.Parameter]]:
    # A 16x12 matrix (compressible), a 12 bias, a 2x2 matrix (too small to gain), a 7 vector.
    shapes = [(16, 12), (12,), (2, 2), (7,)]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    (bucket,) = assign_buckets(params[::-1], 1 << 30, 1 << 30)  # buckets take parameters in reverse
    assert bucket.params == params
    _load(bucket, rank, step, absent, active)
    return bucket, params


def _load(bucket: Bucket, rank: int, step: int, absent: set[int], active: bool = True) -> None:
    bucket.reset()
    for position, param in enumerate(bucket.params):
        param.grad = None if position in absent else (_data(rank * 1000 + step * 10 + position, param.numel(), False)
                                                      .clamp(-TERM_LIMIT, TERM_LIMIT).view_as(param) * active)
        bucket.load(position, 1.0)
    bucket.write_presence()


def _exact(bucket: Bucket, group: Any) -> torch.Tensor:
    expected = bucket.buffer.clone()
    dist.all_reduce(expected, group=group)
    return expected


def _lossy(groups: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    group = groups.replica
    out: dict[str, Any] = {}
    # One step: error against the exact sum; presence counts exact (parameter 3 absent on rank 0,
    # parameter 1 absent everywhere).
    for spec in ["fp16", "bf16", "fp16+ef", "bf16+ef@hierarchical", "powersgd:2", "powersgd:1@hierarchical"]:
        reducer = make_reducer(spec, groups)
        absent = {1} | ({3} if rank == 0 else set())
        bucket, _ = _bucket(rank, 0, absent)
        expected = _exact(bucket, group)
        reducer.reduce(bucket.buffer, group, bucket).wait()
        out[spec] = (bucket.numel, bucket.buffer.clone(), expected, reducer.name)
        reducer.close()  # type: ignore[attr-defined]

    # Error feedback books: a constant gradient from rank 0 only (the wire sum of one term is exact),
    # 20 rounds. With feedback, what was delivered trails the truth by at most one rounding.
    for spec in ["fp16", "fp16+ef", "bf16", "bf16+ef"]:
        reducer = make_reducer(spec, groups)
        bucket, _ = _bucket(rank, 0, set(), active=rank == 0)
        delivered = torch.zeros(bucket.numel)
        truth = torch.zeros(bucket.numel)
        for _ in range(20):
            _load(bucket, rank, 0, set(), active=rank == 0)
            truth += _exact(bucket, group)[: bucket.numel]
            reducer.reduce(bucket.buffer, group, bucket).wait()
            delivered += bucket.buffer[: bucket.numel]
        out["books " + spec] = ((delivered - truth).abs().max().item(), truth.abs().max().item())
        reducer.close()  # type: ignore[attr-defined]

    # PowerSGD's books: over rounds, delivered + what every replica still owes == every gradient
    # ever produced, to fp32 round-off; a parameter absent everywhere keeps its debt.
    reducer = make_reducer("powersgd:1", groups)
    bucket, _ = _bucket(rank, 0, set())
    delivered = torch.zeros(bucket.numel)
    produced = torch.zeros(bucket.numel)
    for step in range(6):
        _load(bucket, rank, step, {0} if step == 5 else set())
        produced += _exact(bucket, group)[: bucket.numel]
        reducer.reduce(bucket.buffer, group, bucket).wait()
        if step < 5:
            delivered += bucket.buffer[: bucket.numel]
    owed = reducer.residual(bucket).clone()  # type: ignore[attr-defined]
    dist.all_reduce(owed, group=group)
    out["powersgd books"] = (delivered, owed, produced, reducer.wire_numel(bucket), bucket.buffer.numel())  # type: ignore[attr-defined]
    reducer.close()  # type: ignore[attr-defined]

    # Rank-1 sums come through rank-1 PowerSGD exactly: M_i = u v_i^T on every replica.
    reducer = make_reducer("powersgd:1", groups)
    bucket, params = _bucket(rank, 0, set())
    u = _data(5, 16, False).clamp(-5, 5)
    params[0].grad = torch.outer(u, _data(100 + rank, 12, False).clamp(-5, 5))
    bucket.reset()
    for position in range(len(params)):
        bucket.load(position, 1.0)
    bucket.write_presence()
    expected = _exact(bucket, group)
    reducer.reduce(bucket.buffer, group, bucket).wait()
    out["powersgd rank one"] = (bucket.buffer.clone(), expected)
    reducer.close()  # type: ignore[attr-defined]
    return out


def _train(reducer: str) -> tuple[float, list[torch.Tensor]]:
    """A small regression trained through rp.Replicator(reducer=...); returns its final full-data loss."""
    repl = rp.Replicator(reducer=reducer)
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 8, generator=generator)
    x = torch.randn(512, 16, generator=generator)
    y = torch.tanh(x @ teacher) + 0.05 * torch.randn(512, 8, generator=generator)
    share = 32 // repl.num_replicas
    for step in range(TRAIN_STEPS):
        rows = torch.arange(step * 32, (step + 1) * 32) % 512
        mine = rows[repl.replica_id * share : (repl.replica_id + 1) * share]
        optimizer.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()
    with torch.no_grad():
        loss = F.mse_loss(model(x), y).item()
    getattr(repl.reducer, "close", lambda: None)()
    return loss, [p.detach().clone() for p in model.parameters()]


def _two_nodes_of_two() -> dict[str, Any]:
    groups = build_process_groups(discover())
    # 40-byte chunks: every size above crosses the levels in several overlapping chunks.
    chunked = ("chunked", lambda: SummationReducer(HierarchicalSum(groups, (2, 2), 60.0, chunk_bytes=40)))
    shm_chunked = ("shm chunked", lambda: SummationReducer(SharedMemorySum(groups, 60.0, per_node=2, chunk_bytes=40)))
    out: dict[str, Any] = {"lossless": _lossless(groups, ["hierarchical", "hierarchical:2x1x2", "hierarchical:1x2x2",
                                                          "auto", chunked, shm_chunked])}
    errors = {}
    for spec in ["hierarchical:4x1", "hierarchical:2x3", "shm"]:
        try:
            make_reducer(spec, groups)
        except ValueError as error:
            errors[spec] = str(error)
    out["errors"] = errors
    # Two stages: replica groups {0, 2} and {1, 3}, one replica of each per node.
    out["stages"] = _lossless(build_process_groups(discover(), stages=2), ["hierarchical"])
    out["lossy"] = _lossy(groups)
    out["train"] = {spec: _train(spec)
                    for spec in ["flat", "hierarchical", "powersgd:1", "powersgd:1+noef", "fp16+ef", "bf16"]}
    return out


def _four_nodes_of_one() -> dict[str, Any]:
    groups = build_process_groups(discover())
    out: dict[str, Any] = {
        "lossless": _lossless(groups, ["hierarchical", "hierarchical:1x2x2", "hierarchical:2x2", "auto"])}
    try:
        make_reducer("hierarchical:2x4", groups)  # with one replica per node any product of 4 fits
        out["error"] = None
    except ValueError as error:
        out["error"] = str(error)
    return out


def _one_node_of_three() -> dict[str, Any]:
    groups = build_process_groups(discover())
    out: dict[str, Any] = {"lossless": _lossless(groups, ["shm", "auto", "flat"])}
    out["train"] = {spec: _train(spec) for spec in ["flat", "shm"]}
    # Buckets allocated by the reducer are rows of its shared mapping: summed in place, no copy in.
    reducer = make_reducer("shm", groups)
    bucket, _ = _bucket(0, 0, set())
    (shared,) = assign_buckets(bucket.params, 1 << 30, 1 << 30, reducer.allocate)  # type: ignore[attr-defined]
    assert shared.buffer.data_ptr() != bucket.buffer.data_ptr()
    _load(shared, dist.get_rank(), 0, {1})
    expected = _exact(shared, groups.replica)
    reducer.reduce(shared.buffer, groups.replica, shared).wait()
    out["in place"] = (shared.buffer.clone(), expected)
    reducer.reduce(torch.ones(5), groups.replica).wait()  # and a staging copy for anything else
    out["left in /dev/shm"] = glob.glob(reducer.summation.path_prefix + "*")  # type: ignore[attr-defined]
    reducer.close()  # type: ignore[attr-defined]
    return out


@pytest.fixture(scope="module")
def one_by_three() -> list[dict[str, Any]]:
    return run_replicas(_one_node_of_three, 3, timeout_s=120)


@pytest.fixture(scope="module")
def two_by_two() -> list[dict[str, Any]]:
    return run_replicas(_two_nodes_of_two, 4, local_world_size=2, timeout_s=180)


@pytest.fixture(scope="module")
def four_by_one() -> list[dict[str, Any]]:
    return run_replicas(_four_nodes_of_one, 4, local_world_size=1, timeout_s=120)


def _check_lossless(results: list[dict[str, Any]], key: str = "lossless", stages: int = 1) -> None:
    for spec in results[0][key]:
        for n, integers in results[0][key][spec]["results"]:
            for rank, result in enumerate(results):
                got, expected = result[key][spec]["results"][(n, integers)]
                first = results[rank % stages][key][spec]["results"][(n, integers)][0]  # replica 0 of this stage
                where = f"{spec} ({result[key][spec]['name']}), {n} elements, rank {rank}"
                if integers:
                    assert torch.equal(got, expected), f"{where}: integer sums differ"
                else:  # the same terms, another order of addition: sum(|terms|) over the replicas (over every
                    # rank here, which covers the stage's replicas), from the inputs each rank drew
                    magnitude = sum(_data(r * 7919 + n * 2, n, False).abs() for r in range(len(results)))
                    assert_within(got, expected, bound(torch.float32, magnitude, len(results) // stages), where)
                # Every replica ends with the same bits: each element is summed once, by its owner.
                assert torch.equal(got, first), f"{where}: replicas disagree"


def test_hierarchical_equals_flat_on_two_nodes_of_two(two_by_two: list[dict[str, Any]]) -> None:
    _check_lossless(two_by_two)
    names = {spec: r["name"] for spec, r in two_by_two[0]["lossless"].items()}
    assert names == {"hierarchical": "hierarchical:2x2", "hierarchical:2x1x2": "hierarchical:2x1x2",
                     "hierarchical:1x2x2": "hierarchical:1x2x2", "auto": "hierarchical:2x2",
                     "chunked": "hierarchical:2x2", "shm chunked": "hierarchical:2x2"}
    # On host memory a hierarchy whose inner level is the node sums inside it through shared memory.
    summations = {spec: r["summation"] for spec, r in two_by_two[0]["lossless"].items()}
    assert summations == {"hierarchical": "SharedMemorySum", "auto": "SharedMemorySum",
                          "hierarchical:2x1x2": "HierarchicalSum", "hierarchical:1x2x2": "HierarchicalSum",
                          "chunked": "HierarchicalSum", "shm chunked": "SharedMemorySum"}


def _own_shared_memory_each() -> str | None:
    groups = build_process_groups(discover())
    # As in separate containers: each process's /dev/shm is its own, though the topology says one node.
    shared_memory.SHARED_MEMORY_DIR = tempfile.mkdtemp(prefix=f"replicator-test-shm-{dist.get_rank()}-")
    try:
        make_reducer("shm", groups)
    except RuntimeError as error:
        return str(error)
    finally:
        shutil.rmtree(shared_memory.SHARED_MEMORY_DIR)
    return None


def test_shared_memory_that_is_not_shared_fails_on_every_replica() -> None:
    errors = run_replicas(_own_shared_memory_each, 2, timeout_s=60)
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} would have summed without its peer's gradients"
        assert "do not share" in error and "reducer='flat'" in error, error


def test_shared_memory_equals_flat_on_one_node(one_by_three: list[dict[str, Any]]) -> None:
    _check_lossless(one_by_three)  # three replicas: slices of uneven length, some empty
    names = {spec: r["name"] for spec, r in one_by_three[0]["lossless"].items()}
    assert names == {"shm": "shm", "auto": "shm", "flat": "flat"}  # one node on CPU: auto picks shared memory
    flat_params, shm_params = one_by_three[0]["train"]["flat"][1], one_by_three[0]["train"]["shm"][1]
    # The same local batches and kernels on both; only the order in which the 3 replicas' gradients add differs.
    tolerance = training_bound(torch.float32, flat_params, 3 + 4, TRAIN_STEPS)
    for index, (a, b) in enumerate(zip(shm_params, flat_params, strict=True)):
        assert_within(a, b, tolerance, f"shared memory vs flat training, parameter {index}")
    for result in one_by_three[1:]:
        assert all(torch.equal(a, b) for a, b in zip(result["train"]["shm"][1], shm_params)), \
            "replicas must agree bit for bit"
    assert all(not result["left in /dev/shm"] for result in one_by_three), \
        "shared segments must be unlinked once mapped"
    for result in one_by_three:
        got, expected = result["in place"]
        assert_within(got, expected, lossless_bound(3), "summed in place")
        assert torch.equal(got, one_by_three[0]["in place"][0]), "replicas disagree"


def _late_presence_on_replica_zero() -> list[torch.Tensor]:
    """`b` gets a gradient on replica 1 only; replica 0's main thread stalls just before writing
    its presence flags, as a descheduled process would. The window's check, which the
    shared-memory sum takes as its first barrier, must not complete before those flags exist."""
    repl = rp.Replicator(reducer="shm")
    write_presence = Bucket.write_presence

    def late(bucket: Bucket) -> None:
        if repl.replica_id == 0:
            time.sleep(0.3)
        write_presence(bucket)

    Bucket.write_presence = late  # type: ignore[method-assign]
    with repl.scope():
        torch.manual_seed(0)
        a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1))
    start = [p.detach().clone() for p in b.parameters()]

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = a(batch).sum() + (b(batch).sum() if ctx.replica_id == 1 else 0.0)
        loss.backward()
        optimizer.step()

    list(repl.run(step_fn, [torch.ones(2, 3)] * 2))
    return [*start, *(p.detach().clone() for p in b.parameters())]


def test_presence_is_written_before_the_sum_may_start() -> None:
    results = run_replicas(_late_presence_on_replica_zero, 2, timeout_s=60)
    weight0, bias0, weight, bias = results[0]
    # Replica 1's gradient of b is 2 per element (two rows of ones); averaged over 2 replicas, 1.
    # Two SGD steps of 0.1 move every element of b by 0.2, on both replicas: two roundings there, one here.
    for got, start in ((weight, weight0), (bias, bias0)):
        assert_within(got, start - 0.2, bound(torch.float32, start.abs() + 0.2, 2), "b after two steps")
    assert all(torch.equal(x, y) for x, y in zip(results[0], results[1])), "replicas diverged"


def test_hierarchical_with_stages(two_by_two: list[dict[str, Any]]) -> None:
    _check_lossless(two_by_two, "stages", stages=2)


def test_hierarchical_equals_flat_on_four_nodes_of_one(four_by_one: list[dict[str, Any]]) -> None:
    _check_lossless(four_by_one)
    assert four_by_one[0]["lossless"]["auto"]["name"] == "flat"  # one replica per node: nothing to gain


def test_levels_that_do_not_fit_raise_on_every_rank(two_by_two: list[dict[str, Any]],
                                                    four_by_one: list[dict[str, Any]]) -> None:
    for result in two_by_two:
        assert "node boundary" in result["errors"]["hierarchical:4x1"]
        assert "multiply to 6 but this job has 4 replicas" in result["errors"]["hierarchical:2x3"]
        assert "reducer 'shm' cannot be used here: the replicas span 2 nodes" in result["errors"]["shm"]
    for result in four_by_one:
        assert "multiply to 8 but this job has 4 replicas" in result["error"]
        assert "'hierarchical:1x4'" in result["error"]


@pytest.mark.parametrize("spec, wire", [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                        ("fp16+ef", torch.float16), ("bf16+ef@hierarchical", torch.bfloat16),
                                        ("powersgd:2", None), ("powersgd:1@hierarchical", None)])
def test_compressed_error_is_bounded_and_presence_exact(two_by_two: list[dict[str, Any]], spec: str,
                                                        wire: torch.dtype | None) -> None:
    first = two_by_two[0]["lossy"][spec][1]
    for rank, result in enumerate(two_by_two):
        numel, got, expected, name = result["lossy"][spec]
        assert torch.equal(got[numel:], expected[numel:]), f"{spec}: presence counts must be exact"
        assert got[numel:].tolist() == [4.0, 0.0, 4.0, 3.0]
        assert torch.equal(got, first), f"{spec}: replica {rank} disagrees with replica 0"
        scale = expected[:numel].abs().max().item()
        if wire is not None:
            # Against the fp32 sum, on the wire's side only: each replica's term rounded to the wire's dtype,
            # their sum of 4 in it (3 roundings), the result back: 5 roundings of sum(|terms|) <= 4 x TERM_LIMIT.
            tolerance = bound(wire, len(two_by_two) * TERM_LIMIT, 1 + (len(two_by_two) - 1) + 1, sides=1)
            assert (got[:numel] - expected[:numel]).abs().max().item() <= tolerance, spec
        else:
            # The 12 bias, the 2x2 matrix and the 7 vector are sent exactly; the 16x12 matrix is approximated.
            assert_within(got[192:numel], expected[192:numel], lossless_bound(len(two_by_two)), spec)
            # Not a rounding bound: a rank-1 or rank-2 approximation of a sum of random 16 x 12 matrices misses most
            # of it, far more than 1% of its scale; a reducer that sent it whole would be within fp32 round-off.
            assert not torch.allclose(got[:192], expected[:192], atol=1e-2 * scale), f"{spec}: nothing was compressed?"
    assert two_by_two[0]["lossy"]["bf16+ef@hierarchical"][3] == "bf16+ef@hierarchical:2x2"


def test_cast_error_feedback_delivers_late_not_never(two_by_two: list[dict[str, Any]]) -> None:
    for wire, quantum in (("fp16", 2.0**-11), ("bf16", 2.0**-8)):
        late, scale = two_by_two[0]["lossy"]["books " + wire + "+ef"]
        never, _ = two_by_two[0]["lossy"]["books " + wire]
        assert late <= 2 * quantum * scale, f"{wire}+ef trails by {late}"
        assert never > 5 * late, f"without feedback {wire} should drift: {never} vs {late}"


def test_powersgd_books_balance_and_compress(two_by_two: list[dict[str, Any]]) -> None:
    for result in two_by_two:
        delivered, owed, produced, wire, plain = result["lossy"]["powersgd books"]
        # Round 5 had the matrix absent everywhere: its sum was dropped, the debt kept.
        # Each of the 6 rounds rounds its delivery, its debt and its fp32 sums of 4 replicas' terms; the debt of
        # all of them adds up: 6 x (4 + 2) roundings of at most 6 rounds' sums of |terms|.
        magnitude = 6 * TERM_LIMIT * len(two_by_two)
        assert_within(delivered[:192] + owed[:192], produced[:192], bound(torch.float32, magnitude, 6 * (4 + 2)),
                      "delivered + owed")
        assert owed[192:].abs().max().item() == 0.0  # exact parts owe nothing
        assert wire == (16 + 12) * 1 + 12 + 4 + 7 + 4 and plain == 16 * 12 + 12 + 4 + 7 + 4
        got, expected = result["lossy"]["powersgd rank one"]
        # Rank one, M = sum_i u v_i^T: PowerSGD's P = M q (12 terms), its normalization (a norm of 16 terms and a
        # division), M^T P (16 terms) and P Q^T (1 term) reproduce M to those roundings of M's size; the exact sum
        # adds 4 replicas' terms u_k v_ij, each within 5 x 5: per element sum(|terms|) <= 4 x 25.
        magnitude = len(two_by_two) * 5.0 * 5.0
        assert_within(got, expected, bound(torch.float32, magnitude, 12 + 16 + 2 + 16 + 1 + len(two_by_two)),
                      "rank one through PowerSGD")


def test_training_through_the_replicator(two_by_two: list[dict[str, Any]]) -> None:
    train = two_by_two[0]["train"]
    flat_loss, flat_params = train["flat"]
    _, hierarchical_params = train["hierarchical"]
    # The same local batches and kernels on both; only the order in which the 4 replicas' gradients add differs.
    tolerance = training_bound(torch.float32, flat_params, 4 + 4, TRAIN_STEPS)
    for index, (a, b) in enumerate(zip(hierarchical_params, flat_params, strict=True)):
        assert_within(a, b, tolerance, f"hierarchical vs flat training, parameter {index}")
    for spec in ["powersgd:1", "fp16+ef", "bf16"]:
        loss, _ = train[spec]
        assert loss <= 1.2 * flat_loss, f"{spec}: final loss {loss:.4f} vs flat {flat_loss:.4f}"
    # Rank 1 without error feedback loses what falls outside the rank-1 subspace for good.
    assert train["powersgd:1+noef"][0] > 1.3 * train["powersgd:1"][0]
    for result in two_by_two[1:]:  # replicas stay identical under every reducer
        for spec, (_, params) in result["train"].items():
            assert all(torch.equal(a, b) for a, b in zip(params, two_by_two[0]["train"][spec][1])), spec

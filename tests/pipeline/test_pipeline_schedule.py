"""Pipeline schedules as data: every (K, M) is deadlock-free and runs each pass once, in order."""

from __future__ import annotations

import pytest

from replicator.pipeline.schedule import (
    Action,
    DeadlockError,
    Op,
    Schedule,
    ScheduleError,
    check_schedule,
    forward_only,
    from_compute_orders,
    make_schedule,
    max_in_flight,
    simulate,
    simulated_bubble,
    timed_simulation,
)

SIZES = [(k, m) for k in range(1, 5) for m in range(1, 9)]


def _passes_once_in_dependency_order(schedule: Schedule) -> None:
    """An independent check of the order, written against the actions rather than with check_schedule."""
    K, M = schedule.num_stages, schedule.num_microbatches
    for stage, actions in enumerate(schedule.stages):
        index = {(a.op, a.microbatch): n for n, a in enumerate(actions)}
        assert len(index) == len(actions), f"stage {stage} repeats an action"
        for i in range(M):
            assert (Op.FORWARD, i) in index and (Op.BACKWARD, i) in index
            assert index[(Op.FORWARD, i)] < index[(Op.BACKWARD, i)]
            if stage > 0:
                assert index[(Op.RECV_ACTIVATION, i)] < index[(Op.FORWARD, i)]
                assert index[(Op.BACKWARD, i)] < index[(Op.SEND_GRADIENT, i)]
            if stage < K - 1:
                assert index[(Op.FORWARD, i)] < index[(Op.SEND_ACTIVATION, i)]
                assert index[(Op.RECV_GRADIENT, i)] < index[(Op.BACKWARD, i)]
        assert sum(a.op is Op.FORWARD for a in actions) == M
        assert sum(a.op is Op.BACKWARD for a in actions) == M


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_every_small_schedule_is_deadlock_free_and_complete(name: str) -> None:
    for K, M in SIZES:
        schedule = make_schedule(name, K, M)
        assert (schedule.num_stages, schedule.num_microbatches) == (K, M)
        check_schedule(schedule)
        _passes_once_in_dependency_order(schedule)
        for rendezvous in (True, False):
            done = simulate(schedule, rendezvous=rendezvous)
            assert len(done) == sum(len(s) for s in schedule.stages)
            # Across stages: a micro-batch's forward runs downstream only after upstream's,
            # its backward upstream only after downstream's.
            order = {(stage, a.op, a.microbatch): n for n, (stage, a) in enumerate(done)}
            for i in range(M):
                for s in range(K - 1):
                    assert order[(s, Op.FORWARD, i)] < order[(s + 1, Op.FORWARD, i)]
                    assert order[(s + 1, Op.BACKWARD, i)] < order[(s, Op.BACKWARD, i)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_matches_gpipe_formula(name: str) -> None:
    for K, M in SIZES:
        for forward, backward in [(1.0, 1.0), (1.0, 2.0)]:
            placed = timed_simulation(make_schedule(name, K, M), forward, backward)
            assert simulated_bubble(placed) == pytest.approx((K - 1) / (M + K - 1))


def test_one_f_one_b_bounds_activations_in_flight() -> None:
    for K, M in SIZES:
        gpipe, ofob = make_schedule("gpipe", K, M), make_schedule("1f1b", K, M)
        for stage in range(K):
            assert max_in_flight(gpipe, stage) == M
            assert max_in_flight(ofob, stage) == min(K - stage, M) <= K


def test_forward_only_schedule() -> None:
    for K, M in SIZES:
        schedule = forward_only(K, M)
        assert not schedule.training
        check_schedule(schedule)
        assert all(a.op is not Op.BACKWARD for s in schedule.stages for a in s)


def test_schedule_text_and_names() -> None:
    schedule = make_schedule("1F1B", 2, 2)
    assert schedule.name == "1f1b"
    assert "stage 1: RA0 F0 B0 SG0 RA1 F1 B1 SG1" in str(schedule)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        make_schedule("round-robin", 2, 2)
    with pytest.raises(ValueError, match="at least 1 micro-batch"):
        make_schedule("gpipe", 2, 0)


def _naive(orders: list[list[Action]]) -> Schedule:
    """Communication placed next to the compute, ignoring the neighbour's order."""
    K = len(orders)
    stages = []
    for s, order in enumerate(orders):
        actions: list[Action] = []
        for a in order:
            if a.op is Op.FORWARD:
                actions += ([Action(Op.RECV_ACTIVATION, a.microbatch)] if s else []) + [a]
                actions += [Action(Op.SEND_ACTIVATION, a.microbatch)] if s < K - 1 else []
            else:
                actions += ([Action(Op.RECV_GRADIENT, a.microbatch)] if s < K - 1 else []) + [a]
                actions += [Action(Op.SEND_GRADIENT, a.microbatch)] if s else []
        stages.append(tuple(actions))
    return Schedule("naive", K, len([a for a in orders[0] if a.op is Op.FORWARD]), tuple(stages))


def test_simulator_finds_a_rendezvous_deadlock() -> None:
    # 1F1B with each send placed right after its compute deadlocks when sends block.
    orders = [list(make_schedule("1f1b", 2, 2).compute_order(s)) for s in range(2)]
    naive = _naive(orders)
    simulate(naive, rendezvous=False)  # buffered sends get through
    with pytest.raises(DeadlockError, match="deadlocks"):
        simulate(naive, rendezvous=True)
    with pytest.raises(DeadlockError):
        check_schedule(naive)


def test_simulator_rejects_mismatched_and_incomplete_schedules() -> None:
    good = make_schedule("gpipe", 2, 2)
    swapped = list(good.stages[1])
    a, b = swapped.index(Action(Op.RECV_ACTIVATION, 0)), swapped.index(Action(Op.RECV_ACTIVATION, 1))
    swapped[a], swapped[b] = swapped[b], swapped[a]
    with pytest.raises(ScheduleError):
        simulate(Schedule("swapped", 2, 2, (good.stages[0], tuple(swapped))), rendezvous=False)
    missing = Schedule("missing", 2, 2, (good.stages[0][:-1], good.stages[1]))
    with pytest.raises(ScheduleError, match="never runs backward"):
        check_schedule(missing)
    with pytest.raises(ScheduleError, match="before its forward"):
        from_compute_orders("bad", [[Action(Op.BACKWARD, 0), Action(Op.FORWARD, 0)]], 1)


def test_incompatible_compute_orders_are_rejected() -> None:
    # Stage 0 wants the gradient of micro-batch 0 before it sends micro-batch 1,
    # but stage 1 runs both forwards before any backward.
    F0, F1, B0, B1 = (Action(Op.FORWARD, 0), Action(Op.FORWARD, 1), Action(Op.BACKWARD, 0), Action(Op.BACKWARD, 1))
    with pytest.raises(ScheduleError, match="needs the gradient of micro-batch 0"):
        from_compute_orders("bad", [[F0, B0, F1, B1], [F0, F1, B0, B1]], 2)

"""Interleaved 1F1B and zero bubble as data: every (K, M, V) in range completes in order, with its bubble."""

from __future__ import annotations

import pytest

from replicator.pipeline.schedule import (
    Op,
    Schedule,
    check_schedule,
    interleaved_1f1b,
    make_schedule,
    max_in_flight,
    one_f_one_b,
    simulate,
    simulated_bubble,
    timed_simulation,
    zero_bubble,
)
from replicator.pipeline.walk import walked

SIZES = [(k, m, v) for k in range(1, 5) for m in range(1, 9) for v in range(1, 4)]


def _interleaved_fits(k: int, m: int) -> bool:
    """torch's rule too: the micro-batches split into max(1, M // K) rounds of equal size."""
    return m % max(1, m // k) == 0


def _each_pass_once_in_order(schedule: Schedule, split: bool) -> None:
    """An independent check, written against the actions: per piece, F < B (or F < I < W), receives before use."""
    K, M, V = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages
    backward_ops = (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if split else (Op.BACKWARD,)
    for stage, actions in enumerate(schedule.stages):
        index = {(a.op, a.microbatch, a.chunk): n for n, a in enumerate(actions)}
        assert len(index) == len(actions), f"stage {stage} repeats an action"
        for chunk in range(V):
            piece = chunk * K + stage
            for i in range(M):
                at = {op: index[(op, i, chunk)] for op in (Op.FORWARD, *backward_ops)}
                assert at[Op.FORWARD] < at[backward_ops[0]] <= at[backward_ops[-1]]
                if piece > 0:
                    assert index[(Op.RECV_ACTIVATION, i, chunk)] < at[Op.FORWARD]
                    assert at[backward_ops[0]] < index[(Op.SEND_GRADIENT, i, chunk)]
                if piece < K * V - 1:
                    assert at[Op.FORWARD] < index[(Op.SEND_ACTIVATION, i, chunk)]
                    assert index[(Op.RECV_GRADIENT, i, chunk)] < at[backward_ops[0]]
        assert sum(a.op is Op.FORWARD for a in actions) == M * V


def test_every_interleaved_schedule_in_range_is_deadlock_free_and_complete() -> None:
    built = 0
    for K, M, V in SIZES:
        if V < 2 or K < 2 or not _interleaved_fits(K, M):
            continue
        schedule = make_schedule("interleaved", K, M, virtual_stages=V)
        assert (schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages) == (K, M, V)
        check_schedule(schedule)
        _each_pass_once_in_order(schedule, split=False)
        built += 1
    assert built > 40


def test_every_zero_bubble_schedule_in_range_is_deadlock_free_and_complete() -> None:
    for K, M, V in SIZES:
        if V > 1 and K < 2:
            continue
        schedule = make_schedule("zero_bubble", K, M, virtual_stages=V)
        check_schedule(schedule)
        _each_pass_once_in_order(schedule, split=True)
        for rendezvous in (True, False):
            assert len(simulate(schedule, rendezvous)) == sum(len(s) for s in schedule.stages)


def test_interleaving_reaches_its_theoretical_bubble() -> None:
    # (K - 1) / (V M + K - 1) when rounds are full: V times less fill and drain than 1F1B.
    for K in range(2, 5):
        for M in range(K, 9, K):
            for V in (2, 3):
                placed = timed_simulation(interleaved_1f1b(K, M, V), 1.0, 2.0)
                assert simulated_bubble(placed) == pytest.approx((K - 1) / (V * M + K - 1))


def test_zero_bubble_beats_1f1b_and_reaches_zb_h1_on_two_stages() -> None:
    for K in range(2, 5):
        for M in range(2, 9):
            one = simulated_bubble(timed_simulation(one_f_one_b(K, M), 1.0, 2.0))
            for V in (1, 2):
                zb = simulated_bubble(timed_simulation(zero_bubble(K, M, V), 1.0, 2.0))
                assert zb < one, (K, M, V)
    for M in range(2, 9):  # ZB-H1 with F = I = W: (K - 1) (F + I - W) idle per stage
        assert simulated_bubble(timed_simulation(zero_bubble(2, M), 1.0, 2.0)) == pytest.approx(1 / (3 * M + 1))


def test_zero_bubble_holds_about_as_many_micro_batches_as_1f1b() -> None:
    for K in range(2, 5):
        for M in range(1, 9):
            schedule = zero_bubble(K, M)
            for stage in range(K):
                # Forwards awaiting their input gradient are bounded as in 1F1B; up to K - s more
                # await only their weight gradient, which needs a part of the activations.
                assert max_in_flight(schedule, stage) <= min(M, 2 * (K - stage))


def test_names_sizes_and_errors() -> None:
    schedule = make_schedule("Interleaved-1F1B", 2, 2, virtual_stages=2)
    assert schedule.name == "interleaved" and "2 stages x 2 chunks x 2 micro-batches" in str(schedule)
    assert "F0v1" in str(schedule) and "W0" in str(make_schedule("zero-bubble", 2, 2))
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        make_schedule("interleaved", 2, 4)
    with pytest.raises(ValueError, match="one model chunk per stage"):
        make_schedule("1f1b", 2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="rounds of equal size"):
        make_schedule("interleaved", 2, 5, virtual_stages=2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        make_schedule("looped-bfs", 2, 4)


def test_timed_simulation_splits_a_stage_into_its_chunks() -> None:
    placed = timed_simulation(interleaved_1f1b(2, 2, 2), forward_time=2.0, backward_time=4.0)
    forwards = [p for p in placed if p.action.op is Op.FORWARD]
    assert all(p.end - p.start == pytest.approx(1.0) for p in forwards)
    split = timed_simulation(zero_bubble(2, 2), 1.0, 2.0, input_time=0.5, weight_time=1.5)
    weights = [p for p in split if p.action.op is Op.BACKWARD_WEIGHT]
    assert weights and all(p.end - p.start == pytest.approx(1.5) for p in weights)


def test_virtual_stages_need_enough_layers_and_a_count_per_piece() -> None:
    from torch import nn

    from replicator.pipeline import build_pipeline

    layers = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(ValueError, match="cut the model into 4 pieces, but it has 3 layer"):
        build_pipeline(layers, stage_id=0, num_stages=2, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match="balance needs 4 layer counts"):
        build_pipeline([*layers, nn.Linear(2, 2)], stage_id=0, num_stages=2, balance=[2, 2], schedule="interleaved",
                       virtual_stages=2)


def test_the_order_gloo_runs_every_schedule_in_completes_and_never_idles_longer() -> None:
    """Each send right after its pass, first in its exchange (walk.py): no deadlock, and never later than the schedule.

    With a message latency the schedule's order (safe when sends block) can keep a send
    behind a receive or behind the next pass while the neighbour waits for it, twice a
    latency where one is due; the walk takes that back, for every schedule in range, and
    strictly for 1F1B, interleaved 1F1B and zero bubble on 2 stages.
    """
    gained = {}
    for K, M, V in SIZES:
        for name in ["gpipe", "1f1b", "zero_bubble"] if V == 1 else ["interleaved", "zero_bubble"]:
            try:
                schedule = make_schedule(name, K, M, V)
            except ValueError:  # sizes the schedule does not take (checked in the tests above)
                continue
            gloo = walked(schedule)
            simulate(gloo, rendezvous=False)
            latency = 0.2
            before = simulated_bubble(timed_simulation(schedule, 1.0, 2.0, latency))
            after = simulated_bubble(timed_simulation(gloo, 1.0, 2.0, latency))
            assert after <= before + 1e-9, (name, K, M, V, before, after)
            gained[(name, K, M, V)] = before - after
    for name, V in [("1f1b", 1), ("interleaved", 2), ("zero_bubble", 2)]:
        assert gained[(name, 2, 8, V)] > 0.02, (name, gained[(name, 2, 8, V)])

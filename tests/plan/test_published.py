"""The published scaling table: sources, one set of global assumptions, per-row errors, leave-one-out, the docs."""

from __future__ import annotations

import pathlib
import statistics

import pytest

from replicator.plan import presets, published
from replicator.plan.transports import TRANSPORTS

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Rows the model misses by more than the 7 points with the one fitted constant; docs/concepts/scaling.md
# says why for each. The test below fails when one of them comes within the target (update the docs) or
# when another row leaves it.
KNOWN_MISSES = {
    "byteps-horovod-bert-large-256",
    "dle-squad-bert-large-16-fp16",
    "dle-squad-bert-large-16-fp32",
    "dle-squad-bert-large-16-fp16-b10",
    "horovod-tcp-resnet101-128",
}


@pytest.fixture(scope="module")
def fitted() -> published.Assumptions:
    return published.fitted_assumptions()


def test_the_table_is_wide_and_every_row_has_a_source() -> None:
    cases = published.PUBLISHED_CASES
    assert len(published.covered()) >= 8
    assert sum(case.published_efficiency < 0.80 for case in published.covered()) >= 2
    assert len({case.key for case in cases}) == len(cases)
    for case in cases:
        assert case.source and case.throughput.source, case.key
        assert case.intra.kind in TRANSPORTS and case.inter.kind in TRANSPORTS, case.key


def test_one_set_of_global_assumptions(fitted: published.Assumptions) -> None:
    # Every row is priced with the same latencies and the same fitted interference; only facts about each
    # system (its hardware, its measured throughput, its message size) differ between rows.
    for case in published.PUBLISHED_CASES:
        levels = case.cluster(fitted).levels(case.gpus)
        assert {level.latency for level in levels} <= {fitted.intra_latency, fitted.network_latency}
    assert 0 <= fitted.interference <= 1
    # The constant `replicator plan` and `--reproduce` use is this fit: refit, it must not have moved.
    assert fitted == published.MODEL and fitted.interference == presets.INTERFERENCE


def test_published_rows_against_the_targets(fitted: published.Assumptions) -> None:
    errors = {case.key: abs(case.predict(fitted) - case.published_efficiency) * 100 for case in published.covered()}
    missing = {key for key, error in errors.items() if error > 7}
    assert missing == KNOWN_MISSES, {key: round(errors[key], 1) for key in missing ^ KNOWN_MISSES}
    within = [error for key, error in errors.items() if key not in KNOWN_MISSES]
    assert statistics.median(within) <= 3.5, sorted(within)


def test_leave_one_out_refits_without_the_row() -> None:
    results = published.leave_one_out()
    assert len(results) == len(published.covered())
    errors = {case.key: abs(efficiency - case.published_efficiency) * 100 for case, _, efficiency in results}
    # Within 10 points for every row the model covers, except the known misses.
    assert all(error <= 10 for key, error in errors.items() if key not in KNOWN_MISSES), errors
    # The refit moves: each row pulls on the fitted constant.
    assert len({round(value, 4) for _, value, _ in results}) > 1


def test_docs_quote_the_tables_from_the_code(fitted: published.Assumptions) -> None:
    page = "docs/concepts/scaling.md"
    doc = (ROOT / page).read_text()
    assert published.inputs_table() in doc, f"{page}: refresh from published.inputs_table()"
    assert published.reproduction_table(fitted) in doc, f"{page}: refresh from published.reproduction_table()"
    assert published.leave_one_out_table() in doc, f"{page}: refresh from published.leave_one_out_table()"

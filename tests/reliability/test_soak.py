"""The soak (tests/reliability/soak.py): mixed traffic against the default model with the
server's resident memory sampled. A minute of it runs with every suite; the 30-minute
run that shows memory levelling off is slow-marked (``make soak`` runs it alone)."""

from __future__ import annotations

import pytest

from tests.reliability import soak
from tests.reliability.conftest import Measure


def check(report: dict[str, object]) -> None:
    assert report["server_errors"] == 0, report["failures"]
    assert report["failures"] == [], report["failures"]
    assert report["log_errors"] == [], report["log_errors"]
    kinds = report["by_kind"]
    assert isinstance(kinds, dict) and set(kinds) == set(soak.KINDS), kinds


@pytest.mark.timeout(600)
def test_a_minute_of_mixed_traffic(measure: Measure) -> None:
    report = soak.run(minutes=1.0, workers=12)
    check(report)
    measure(requests=report["requests"], ready_mib=report["ready_mib"],
            peak_mib=report["peak_mib"])
    assert report["peak_mib"] <= report["bound_mib"]["total"]


@pytest.mark.slow
@pytest.mark.timeout(45 * 60)
def test_resident_memory_levels_off_over_half_an_hour(measure: Measure) -> None:
    report = soak.run(minutes=30.0)
    check(report)
    measure(requests=report["requests"], ready_mib=report["ready_mib"],
            peak_mib=report["peak_mib"], warm_thirds_max_mib=report["warm_thirds_max_mib"],
            bound_mib=report["bound_mib"]["total"])
    assert soak.levelled_off(report), report["warm_thirds_max_mib"]

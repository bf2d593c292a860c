"""Reliability fixtures: the gateway fixtures (tiny engine, clean environment)
and a record of measurements, printed at the end of the run."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.gateway.conftest import _no_specserve_env, tiny_engine

__all__ = ["_no_specserve_env", "measure", "tiny_engine"]

MEASUREMENTS = pytest.StashKey[list[str]]()

Measure = Callable[..., None]


@pytest.fixture
def measure(request: pytest.FixtureRequest) -> Measure:
    """``measure(**values)`` records one line for the end-of-run summary."""

    def record(**values: object) -> None:
        line = f"{request.node.nodeid}: " + ", ".join(f"{k}={v}" for k, v in values.items())
        request.config.stash.setdefault(MEASUREMENTS, []).append(line)

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    lines = config.stash.get(MEASUREMENTS, [])
    if lines:
        terminalreporter.section("reliability measurements")
        for line in lines:
            terminalreporter.write_line(line)

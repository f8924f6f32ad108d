"""The lifetime tests' knobs: how many create/call/destroy cycles (``--lifetime-cycles``, default 1,000), and how
long they may take (``--lifetime-seconds``: past it the ranks stop together, and the record says how many cycles
ran), so a device call with less time left runs fewer and says so."""

import pytest

DEFAULT_CYCLES = 1000


def pytest_addoption(parser):
    parser.addoption("--lifetime-cycles", type=int, default=DEFAULT_CYCLES,
                     help=f"create/call/destroy cycles of the lifetime test (default {DEFAULT_CYCLES})")
    parser.addoption("--lifetime-seconds", type=float, default=None,
                     help="stop the cycles once this many seconds have passed (default: no limit)")


@pytest.fixture
def lifetime_cycles(request) -> int:
    cycles = request.config.getoption("--lifetime-cycles")
    if cycles < 2:
        raise pytest.UsageError("--lifetime-cycles must be at least 2 (the first cycle is the baseline)")
    return cycles


@pytest.fixture
def lifetime_seconds(request) -> float | None:
    seconds = request.config.getoption("--lifetime-seconds")
    if seconds is not None and seconds <= 0:
        raise pytest.UsageError("--lifetime-seconds must be positive")
    return seconds

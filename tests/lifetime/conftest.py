"""The lifetime tests' knob: how many create/call/destroy cycles (``--lifetime-cycles``, default 1,000), so a
device call with less time left can run fewer and say so in its record."""

import pytest

DEFAULT_CYCLES = 1000


def pytest_addoption(parser):
    parser.addoption("--lifetime-cycles", type=int, default=DEFAULT_CYCLES,
                     help=f"create/call/destroy cycles of the lifetime test (default {DEFAULT_CYCLES})")


@pytest.fixture
def lifetime_cycles(request) -> int:
    cycles = request.config.getoption("--lifetime-cycles")
    if cycles < 2:
        raise pytest.UsageError("--lifetime-cycles must be at least 2 (the first cycle is the baseline)")
    return cycles

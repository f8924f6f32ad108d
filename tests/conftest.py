"""Shared test plumbing: GPU skipping, the per-process runtime, the transport property, and the MPI
abort-on-failure hook. Fixtures and hooks only: what test modules import lives in tests/helpers/."""

from __future__ import annotations

import os
import sys

import pytest

# Imported before torch initialises CUDA (tests.helpers.devices, below): importing chunkring defaults
# CUDA_MODULE_LOADING to EAGER (chunkring.env.EAGER_LOADING), which the MoE layer requires.
import chunkring

# The helper modules' asserts report like the tests' own (imported below or by test modules: after this).
pytest.register_assert_rewrite("tests.helpers", "tests.gpu.moe_helpers", "tests.gpu.ring_helpers",
                               "tests.gpu.graph_helpers")

from tests.helpers.devices import HAVE_GPU  # noqa: E402

UNDER_MPI = "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def pytest_addoption(parser):
    parser.addoption("--transport", choices=("auto", "rma"), default=None,
                     help="how every ring reaches its peers' slots (sets CHUNKRING_TRANSPORT for the session; "
                          "rma: NVSHMEM gets/puts for every peer, self included)")


def pytest_configure(config):
    transport = config.getoption("--transport")
    if transport is not None:
        os.environ["CHUNKRING_TRANSPORT"] = transport  # read by every Ring built afterwards


@pytest.fixture(scope="session", autouse=True)
def transport_property(record_testsuite_property):
    """Which transport the session ran, as a JUnit property scripts/gpu_summary.py reports (1: forced RMA)."""
    record_testsuite_property("transport_rma", int(chunkring.env.transport_mode() == "rma"))


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible: torch.cuda.device_count() == 0)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Under mpirun, a rank that fails alone would leave its peers blocked in the next collective until
    # the outer timeout. Abort the whole job instead, so a failure ends the run in seconds.
    outcome = yield
    report = outcome.get_result()
    if UNDER_MPI and report.failed and int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))) > 1:
        from mpi4py import MPI

        sys.stderr.write(f"\n[rank {MPI.COMM_WORLD.Get_rank()}] {item.nodeid} failed; aborting the MPI job\n")
        sys.stderr.write(report.longreprtext + "\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture(scope="session")
def runtime():
    """This process's chunkring runtime (CUDA + NVSHMEM), shared by every GPU test, closed at the end."""
    rt = chunkring.init()
    yield rt
    rt.close()

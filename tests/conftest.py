"""Shared test plumbing: GPU skipping, the per-process runtime, the transport property, the MPI abort-on-failure
hook, pytest-mpi's banner as one line, the SPIN checks started in the background (tests/model/spin_driver.py) and
the terminal summary's last words. Fixtures and hooks only: what test modules import lives in tests/helpers/."""

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


@pytest.hookimpl(trylast=True)  # after pytest-mpi's own pytest_configure has registered its plugin
def pytest_configure(config):
    transport = config.getoption("--transport")
    if transport is not None:
        os.environ["CHUNKRING_TRANSPORT"] = transport  # read by every Ring built afterwards
    _one_line_mpi_banner(config)


def _one_line_mpi_banner(config) -> None:
    """pytest-mpi's end-of-run "MPI Information" section prints mpi4py 4's ``rc`` and ``get_config()`` as empty
    fields and the library version with its C terminator (a raw NUL): replace it by one line saying the same, the
    plugin's markers and options kept."""
    try:
        from pytest_mpi import WITH_MPI_ARG, MPIPlugin
    except ImportError:  # no pytest-mpi: no --with-mpi either
        return

    class OneLineBanner(MPIPlugin):
        def pytest_terminal_summary(self, terminalreporter, exitstatus, *args):
            if not terminalreporter.config.getoption(WITH_MPI_ARG):
                return
            import mpi4py
            from mpi4py import MPI

            vendor, version = MPI.get_vendor()
            standard = ".".join(map(str, MPI.Get_version()))
            terminalreporter.write_line(f"MPI: rank {MPI.COMM_WORLD.rank} of {MPI.COMM_WORLD.size}, {vendor} "
                                        f"{'.'.join(map(str, version))} (MPI {standard}, mpi4py {mpi4py.__version__})")

    for plugin in config.pluginmanager.get_plugins():
        if type(plugin) is MPIPlugin:
            config.pluginmanager.unregister(plugin)
            config.pluginmanager.register(OneLineBanner())


@pytest.fixture(scope="session", autouse=True)
def transport_property(record_testsuite_property):
    """Which transport the session ran, as a JUnit property scripts/gpu_summary.py reports (1: forced RMA)."""
    record_testsuite_property("transport_rma", int(chunkring.env.transport_mode() == "rma"))


def pytest_collection_modifyitems(config, items):
    # The SPIN model checks last: their searches start in the background once collection ends
    # (tests/model/spin_driver.py), so the other tests run meanwhile on the cores the searches leave.
    items.sort(key=lambda item: item.get_closest_marker("spin") is not None)
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible: torch.cuda.device_count() == 0)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the selected SPIN checks in the background (the ``spin`` marker; after -k / -m selection)."""
    spin = [item for item in session.items if item.get_closest_marker("spin") is not None]
    if spin and not session.config.option.collectonly:
        from tests.model.spin_driver import BACKGROUND, default_workers

        BACKGROUND.start([item.callspec.params["cfg"] for item in spin], default_workers())


def pytest_sessionfinish(session):
    from tests.model.spin_driver import BACKGROUND

    BACKGROUND.stop()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """The SPIN searches' times, last."""
    _spin_summary(terminalreporter)


def _spin_summary(terminalreporter) -> None:
    """The SPIN searches' own times: --durations shows how long each SPIN test waited, not how long its search
    took beside the other tests."""
    from tests.model.spin_driver import BACKGROUND

    done = sorted(BACKGROUND.finished, key=lambda r: -r.seconds)
    if not done:
        return
    terminalreporter.section("SPIN model checks (run beside the other tests)")
    terminalreporter.write_line(f"{len(done)} searches, {sum(r.seconds for r in done):.0f} s in all; the slowest:")
    for r in done[:8]:
        terminalreporter.write_line(f"  {r.seconds:6.1f} s  {r.name} ({r.states} states)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Under mpirun, a rank that fails alone would leave its peers blocked in the next collective until
    # the outer timeout. Abort the whole job instead, so a failure ends the run in seconds.
    # A test marked lockstep asserts on what every rank allgathered, so every rank fails it alike and the ranks
    # stay in step: the job goes on to the next test (the fault matrix: one failing cell keeps the others).
    outcome = yield
    report = outcome.get_result()
    lockstep = report.when == "call" and item.get_closest_marker("lockstep") is not None
    if UNDER_MPI and report.failed and not lockstep and int(
            os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))) > 1:
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

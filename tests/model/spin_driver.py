"""What both SPIN test files share: scripts/check_model.py loaded once as a module, the tool check,
one configuration's verdict, and the pool that runs the checks beside the other tests.

Each check is one exhaustive pan search on one core (1-40 s; about 5 minutes for all of them). When a session
has collected its SPIN tests (the ``spin`` marker), :data:`BACKGROUND` starts them, longest first, on
``CHUNKRING_SPIN_JOBS`` threads (default: one fewer than the CPUs, at least one), while the session runs its
other tests - which tests/conftest.py puts first - so the searches use the cores the rest leaves idle. A SPIN
test then takes its configuration's result, running it itself if no worker has started it yet. Every search
is the one check_model.py runs; only when it runs changes.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

_DRIVER = Path(__file__).resolve().parents[2] / "scripts" / "check_model.py"
_spec = importlib.util.spec_from_file_location("chunkring_check_model", _DRIVER)
check_model = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = check_model   # dataclasses need the module registered
_spec.loader.exec_module(check_model)

MISSING = [t for t in ("spin", "gcc") if shutil.which(t) is None]
WHY = f"SPIN model check needs {' and '.join(MISSING)} on PATH (apt-get install spin gcc)"
#: scripts/test.sh sets it: a suite it promises must run, so a missing tool is a failure, not a skip.
REQUIRED = os.environ.get("CHUNKRING_REQUIRE_SPIN") == "1"
needs_tools = pytest.mark.skipif(bool(MISSING), reason=WHY)


class BackgroundChecks:
    """SPIN checks started ahead of their tests on a few worker threads (each waits on its pan process)."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._futures: dict[str, concurrent.futures.Future] = {}
        # Read once, before any test's fixture changes CHUNKRING_CACHE_DIR (tests/compile's private kernel cache).
        self._cache = check_model.cache_root()
        self._lock = threading.Lock()
        self.finished: list = []  # every Result, as its test took it

    def start(self, configs, workers: int) -> None:
        """Start ``configs`` (longest first) on ``workers`` threads."""
        if MISSING or not configs or workers < 1:
            return
        self._cache = check_model.cache_root()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="spin")
        for cfg in check_model.longest_first(configs):
            self._futures[cfg.name] = self._pool.submit(check_model.run_config, cfg, cache=self._cache)

    def result(self, cfg):
        """``cfg``'s Result: a worker's, or this thread's own run if no worker has started it."""
        with self._lock:
            future = self._futures.pop(cfg.name, None)
        if future is None or future.cancel():
            res = check_model.run_config(cfg, cache=self._cache)
        else:
            res = future.result()
        self.finished.append(res)
        return res

    def stop(self) -> None:
        """Cancel what has not started and end what runs (a session that ends before its SPIN tests ran)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            check_model.stop_all()
            self._pool = None


def default_workers() -> int:
    """``CHUNKRING_SPIN_JOBS``, or one fewer than the CPUs this process may use (at least one): the session's
    own thread runs the other tests, then joins in with the checks no worker has started."""
    if os.environ.get("CHUNKRING_SPIN_JOBS"):
        return int(os.environ["CHUNKRING_SPIN_JOBS"])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus - 1)


BACKGROUND = BackgroundChecks()


def check_config(cfg) -> None:
    """Run one configuration: a passing one must find no counterexample, a bug must violate its rule."""
    res = BACKGROUND.result(cfg)
    summary = (f"{cfg.name} ({' '.join(cfg.macros)}): errors={res.errors} "
               f"states={res.states} violated={res.violated} {res.detail}")
    assert res.errors is not None, "pan printed no 'errors:' line: " + summary
    assert res.truncated is None, "search truncated: " + summary
    if cfg.expect == check_model.PASS:
        assert res.errors == 0, "correct model has a counterexample: " + summary
    else:
        assert res.errors >= 1, f"bug not detected ({cfg.why}): " + summary
        assert res.violated and res.violated.startswith(cfg.prop), (
            f"counterexample violates the wrong rule, expected {cfg.prop}: " + summary)
    assert res.ok, summary


def assert_macros_only_in(model: str, macros: set[str]) -> None:
    """``macros`` (one model's variant macros) are passed to no configuration of another model."""
    for c in check_model.CONFIGS:
        if c.model != model:
            assert not macros & set(c.macros), c.name

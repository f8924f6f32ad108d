"""What both SPIN test files share: scripts/check_model.py loaded once as a module, the tool check and
one configuration's verdict."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
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


def check_config(cfg) -> None:
    """Run one configuration: a passing one must find no counterexample, a bug must violate its rule."""
    res = check_model.run_config(cfg)
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

"""The GPU suite summary counts what JUnit recorded (rank 0's counts, any rank's failures), keeps the keys
every committed result must have, and says no more than was measured: whether each build was a cache hit,
and whether the tree that ran differed from its commit."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="{errors}"
failures="{failures}" skipped="{skipped}" tests="{tests}"></testsuite></testsuites>"""


def write(path, **counts):
    path.write_text(JUNIT.format(**counts))
    return str(path)


def summarise(tmp_path, rc, *junit, env=None):
    out = tmp_path / "summary.json"
    cold, warm = tmp_path / "build_cold.json", tmp_path / "build_warm.json"
    cold.write_text(json.dumps({"selftest": {"seconds": 4.1, "cache_hit": False, "key": "k"}}))
    warm.write_text(json.dumps({"selftest": {"seconds": 0.0004, "cache_hit": True, "key": "k"}}))
    # This checkout's package, not whatever an editable install elsewhere points at.
    path = os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, str(REPO / "scripts/gpu_summary.py"), "--suite", "s", "--ranks", str(len(junit)),
                    "--rc", str(rc), "--seconds", "12", "--junit", *junit, "--build", str(cold), str(warm),
                    "--command", "c", "--out", str(out)],
                   check=True, capture_output=True,
                   env={"CHUNKRING_COMMIT": "abc1234", "PATH": "", "PYTHONPATH": path, **(env or {})})
    return json.loads(out.read_text())


def test_counts_and_required_keys(tmp_path):
    s = summarise(tmp_path, 0, write(tmp_path / "r0.xml", errors=0, failures=0, skipped=2, tests=10))
    for key in ("commit", "gpu", "gpus", "ranks", "suite", "command", "passed", "failed", "skipped", "figures"):
        assert key in s
    assert (s["commit"], s["passed"], s["failed"], s["skipped"]) == ("abc1234", 8, 0, 2)
    assert s["figures"]["build_cold_selftest_s"] == 4.1 and s["figures"]["suite_seconds"] == 12


def test_any_rank_failure_counts(tmp_path):
    r0 = write(tmp_path / "r0.xml", errors=0, failures=0, skipped=0, tests=5)
    r1 = write(tmp_path / "r1.xml", errors=1, failures=1, skipped=0, tests=5)
    s = summarise(tmp_path, 1, r0, r1)
    assert s["passed"] == 5 and s["failed"] == 2 and s["ranks_reporting"] == 2


def test_a_crash_without_junit_is_a_failure(tmp_path):
    s = summarise(tmp_path, 1, str(tmp_path / "missing.xml"))
    assert s["failed"] >= 1 and s["passed"] == 0


def test_numeric_suite_properties_become_figures(tmp_path):
    path = tmp_path / "r0.xml"
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="0" skipped="0" '
                    'tests="1"><properties><property name="fuzz_cases_x_sf_rank0" value="220"/>'
                    '<property name="note" value="text"/></properties></testsuite></testsuites>')
    s = summarise(tmp_path, 0, str(path))
    assert s["figures"]["fuzz_cases_x_sf_rank0"] == 220 and "note" not in s["figures"]


def test_the_summary_says_which_transport_ran(tmp_path):
    plain = summarise(tmp_path, 0, write(tmp_path / "r0.xml", errors=0, failures=0, skipped=0, tests=1))
    assert plain["transport"] == "auto"
    path = tmp_path / "r1.xml"
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="0" skipped="0" '
                    'tests="1"><properties><property name="transport_rma" value="1"/></properties></testsuite>'
                    '</testsuites>')
    forced = summarise(tmp_path, 0, str(path))
    assert forced["transport"] == "rma" and forced["figures"]["transport_rma"] == 1


def test_each_build_keeps_its_cache_hit(tmp_path):
    s = summarise(tmp_path, 0, write(tmp_path / "r0.xml", errors=0, failures=0, skipped=0, tests=1))
    assert s["builds"]["build_cold"]["selftest"] == {"seconds": 4.1, "cache_hit": False}
    assert s["builds"]["build_warm"]["selftest"] == {"seconds": 0.0004, "cache_hit": True}
    assert s["figures"]["build_warm_selftest_s"] == 0.0004


def test_the_summary_says_whether_the_tree_differed_from_its_commit(tmp_path):
    junit = write(tmp_path / "r0.xml", errors=0, failures=0, skipped=0, tests=1)
    assert summarise(tmp_path, 0, junit)["tree_modified"] is None  # nobody said
    assert summarise(tmp_path, 0, junit, env={"CHUNKRING_TREE_MODIFIED": "1"})["tree_modified"] is True
    assert summarise(tmp_path, 0, junit, env={"CHUNKRING_TREE_MODIFIED": "0"})["tree_modified"] is False

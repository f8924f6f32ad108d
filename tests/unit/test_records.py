"""Every result file starts with the same keys (chunkring.testing.records.header), whoever writes it: the
benchmarks, the GPU suite's summaries (scripts/gpu_summary.py, tests/unit/test_gpu_summary.py) and the
launcher's --json report (tests/unit/test_launcher.py)."""

import subprocess
from pathlib import Path

from chunkring.testing import records

REPO = Path(__file__).resolve().parents[2]
KEYS = ("commit", "tree_modified", "gpu", "gpus", "ranks", "suite", "command", "passed", "failed", "skipped")


def test_the_header_names_the_commit_the_caller_gave_and_the_counts(monkeypatch):
    monkeypatch.setenv("CHUNKRING_COMMIT", "abc1234")
    monkeypatch.setenv(records.TREE_MODIFIED_VAR, "1")
    head = records.header(suite="s", ranks=4, command="cmd", passed=3, failed=1, skipped=2, gpu="Fake GPU")
    assert all(key in head for key in KEYS)
    assert (head["commit"], head["tree_modified"], head["gpu"], head["ranks"]) == ("abc1234", True, "Fake GPU", 4)
    assert (head["passed"], head["failed"], head["skipped"]) == (3, 1, 2)


def test_without_a_commit_given_a_checkout_names_its_head(monkeypatch):
    monkeypatch.delenv("CHUNKRING_COMMIT", raising=False)
    monkeypatch.delenv(records.TREE_MODIFIED_VAR, raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    expected = head.stdout.strip() or "unknown"  # a copy without .git (the GPU host's) cannot say
    assert records.commit() == expected
    assert records.header(suite="s", ranks=1, command="c", passed=1, failed=0)["tree_modified"] is None



def test_a_table_record_names_each_rows_floats_by_shape_and_tokens(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("CHUNKRING_COMMIT", "abc1234")
    rows = [{"shape": "flash", "tokens": 8, "engine": "decode", "layer_ms": 0.25, "rows_max": 3},
            {"shape": "v3", "tokens": 1, "layer_ms": 0.5}]
    path = tmp_path / "t.json"
    records.write_table(str(path), suite="t", rows=rows, incomplete=True)
    got = json.loads(path.read_text())
    assert all(key in got for key in KEYS) and got["records"] == rows and got["incomplete"] is True
    assert got["figures"] == {"flash_8_layer_ms": 0.25, "v3_1_layer_ms": 0.5}  # floats only
    records.write_table(None, suite="t", rows=rows)  # no path: nothing written, no error

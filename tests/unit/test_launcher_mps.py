"""The launcher's private MPS daemon (``--mps``) leaves no temporary directory behind after a job, and keeps (and
names) only the log of a daemon that failed. A stand-in ``nvidia-cuda-mps-control`` on PATH plays the daemon."""

import tempfile

import pytest

from chunkring.errors import ChunkringUsageError
from chunkring_launch.mps import private_mps

FAKE_CONTROL = """#!/bin/sh
# -d starts the daemon; anything else reads a command ("quit") from stdin
if [ "$1" = "-d" ]; then exit "${FAKE_MPS_START:-0}"; fi
cat > /dev/null
exit "${FAKE_MPS_QUIT:-0}"
"""


@pytest.fixture
def temp(tmp_path, monkeypatch):
    """A PATH with the stand-in control command, and an empty folder that tempfile makes its directories in."""
    bin_dir, temp_dir = tmp_path / "bin", tmp_path / "tmp"
    bin_dir.mkdir()
    temp_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(FAKE_CONTROL)
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(tempfile, "tempdir", str(temp_dir))
    return temp_dir


def test_a_job_leaves_no_mps_directory(temp):
    environ = {}
    with private_mps(environ, dry_run=False):
        assert sorted(p.name.rsplit("-", 1)[0] for p in temp.iterdir()) == ["chunkring-mps-log", "chunkring-mps-pipe"]
    assert list(temp.iterdir()) == []


def test_a_daemon_that_did_not_start_keeps_only_its_log(temp):
    with pytest.raises(ChunkringUsageError) as info, private_mps({"FAKE_MPS_START": "1"}, dry_run=False):
        pass
    (log,) = temp.iterdir()
    assert log.name.startswith("chunkring-mps-log-") and f"its log: {log}" in str(info.value)


def test_a_daemon_gone_by_the_end_keeps_only_its_log(temp, capsys):
    with private_mps({"FAKE_MPS_QUIT": "1"}, dry_run=False):
        pass
    (log,) = temp.iterdir()
    assert log.name.startswith("chunkring-mps-log-") and f"its log: {log}" in capsys.readouterr().err

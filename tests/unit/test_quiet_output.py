"""The test suites' output carries what the tests found, not noise (no warnings of ours, no pytest-mpi banner of empty
fields): a warning raised in our code fails its test (pyproject.toml's filterwarnings, shown here on a probe), a third
party's is reported as usual, and a --with-mpi run ends with one line about MPI (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest


def test_a_warning_raised_in_our_code_fails_its_test():
    with pytest.raises(UserWarning, match="a probe"):
        warnings.warn("a probe", UserWarning, stacklevel=1)  # attributed to this module, test_quiet_output


def test_a_third_partys_warning_is_only_reported():
    with pytest.warns(UserWarning, match="a probe"):
        warnings.warn_explicit("a probe", UserWarning, "somelib/x.py", 1, module="somelib.x")


def test_a_with_mpi_run_ends_with_one_line_about_mpi(tmp_path):
    (tmp_path / "test_one.py").write_text('"""One passing test."""\n\n\ndef test_one():\n    pass\n')
    proc = subprocess.run([sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                           f"--rootdir={tmp_path}", "-c", "/dev/null", "-p", "tests.conftest", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-2].startswith("MPI: rank 0 of 1, ") and "(MPI " in lines[-2], lines
    assert "MPI Information" not in proc.stdout and "mpi4py rc:" not in proc.stdout and "\x00" not in proc.stdout

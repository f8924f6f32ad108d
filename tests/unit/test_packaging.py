"""What a packager checks (issue 45 item 11): the LICENSE pyproject.toml names ships in the wheel and the sdist
(built from a copy of the tree by the build backend pyproject.toml names), and ``chunkring.__version__`` is the
installed version, or pyproject.toml's in a source tree that is not installed."""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import chunkring

REPO = Path(__file__).resolve().parents[2]
#: sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt, the text SPDX's Apache-2.0 names.
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
#: What a build reads: the project's metadata and the folders its packages and their data come from.
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "runtime", "launcher", "device", "configs")


def test_the_license_is_apache_2_0_as_pyproject_says():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert hashlib.sha256((REPO / "LICENSE").read_bytes()).hexdigest() == APACHE_2_0_SHA256


def test_the_wheel_and_the_sdist_carry_the_license(tmp_path):
    tree, out = tmp_path / "tree", tmp_path / "dist"
    for name in BUILD_INPUTS:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, tree / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, tree / name)
    backend = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["build-backend"]
    code = (f"import {backend} as backend\n"
            f"wheel = backend.build_wheel({str(out)!r})\n"
            f"sdist = backend.build_sdist({str(out)!r})\n"
            "print('built', wheel, sdist)\n")
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, wheel_name, sdist_name = proc.stdout.strip().splitlines()[-1].split()  # after the backend's own lines
    license_text = (REPO / "LICENSE").read_bytes()
    with zipfile.ZipFile(out / wheel_name) as wheel:
        dist_info = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        assert wheel.read(f"{dist_info}/licenses/LICENSE") == license_text
        metadata = wheel.read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    with tarfile.open(out / sdist_name) as sdist:
        top = sdist_name.removesuffix(".tar.gz")
        assert sdist.extractfile(f"{top}/LICENSE").read() == license_text


def test_the_version_is_the_installed_one():
    assert chunkring.__version__ == importlib.metadata.version("chunkring")
    assert "__version__" in dir(chunkring)


def test_a_source_tree_that_is_not_installed_reads_its_pyproject(tmp_path):
    """Without site-packages (python -S; and not in the checkout, whose build leaves chunkring.egg-info there)
    the installed metadata is not found: the version comes from the tree."""
    code = ("import importlib.metadata, sys\n"
            f"sys.path.insert(0, {str(REPO / 'runtime')!r})\n"
            "import chunkring\n"
            "try:\n"
            "    importlib.metadata.version('chunkring')\n"
            "    sys.exit('chunkring is installed where python -S looks')\n"
            "except importlib.metadata.PackageNotFoundError:\n"
            "    print(chunkring.__version__)\n")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                          check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

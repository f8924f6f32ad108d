"""``chunkring.__version__``: the installed distribution's version (its metadata), or in a source tree that is
not installed the version its ``pyproject.toml`` declares. Read at first use of ``chunkring.__version__``
(:mod:`chunkring._lazy`), so ``import chunkring`` reads no metadata."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["__version__"]

#: Where a source tree keeps its pyproject.toml: runtime/chunkring/ is the package's folder.
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def read_version(pyproject: Path = PYPROJECT) -> str:
    """The installed chunkring's version, else ``pyproject``'s (the project named chunkring), else ``0+unknown``."""
    try:
        return version("chunkring")
    except PackageNotFoundError:
        pass
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    except (OSError, UnicodeDecodeError, KeyError, tomllib.TOMLDecodeError):
        return "0+unknown"
    return str(project["version"]) if project.get("name") == "chunkring" and "version" in project else "0+unknown"


__version__ = read_version()

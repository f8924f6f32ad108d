"""Package facades whose names are imported at first use (PEP 562), so that ``import chunkring`` - and a
config check, ``chunkring-launch --help``, anything reading only the package's small modules - imports no
torch, CUDA, NVSHMEM or MPI module.

A facade lists its names in ``_EXPORTS`` (name -> the module defining it; the import-graph test reads these
as the facade's imports) and in an ``if TYPE_CHECKING:`` block for type checkers, and installs
:func:`attach`'s ``__getattr__``/``__dir__``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["attach"]


def attach(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: a name of ``exports`` is imported from its module at
    first use and kept in the package; any other name is tried as a submodule (``chunkring.moe``), as if the
    package had imported it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__

"""chunkring_launch: the ``chunkring-launch`` command (one process per GPU rank, started by mpirun)."""

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    from .cli import main as _main

    return _main(argv)

"""chunkring_launch: the ``chunkring-launch`` command (one process per GPU rank, started by mpirun)."""

__all__ = ["main"]


def main(argv=None) -> int:
    from .cli import main as _main

    return _main(argv)

"""The two kinds of failure chunkring reports.

``ChunkringUsageError``: the caller asked for something impossible or unsafe (bad shape, bad config,
wrong stream, a destroyed object). Raised before any GPU work starts.

``ChunkringRuntimeError``: the machine failed us (CUDA, NVRTC, NVSHMEM, MPI, a device-side watchdog).
"""

__all__ = ["ChunkringError", "ChunkringUsageError", "ChunkringRuntimeError", "NoGpuError"]


class ChunkringError(Exception):
    """Base class of every error chunkring raises on purpose."""


class ChunkringUsageError(ChunkringError, ValueError):
    """Invalid arguments or misuse; ``field`` names the offending argument when there is one."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class ChunkringRuntimeError(ChunkringError, RuntimeError):
    """A CUDA, NVRTC, NVSHMEM or MPI operation failed, or a device watchdog fired."""


class NoGpuError(ChunkringRuntimeError):
    """No CUDA device is visible to this process."""

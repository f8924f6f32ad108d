"""How many GPUs this node shows a job: from the NVIDIA driver's device files, without importing torch or
CUDA (what ``--dry-run`` and the no-GPU answer use), and from torch (what a real launch sizes itself by)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from chunkring.errors import ChunkringUsageError

__all__ = ["driver_gpu_count", "torch_gpu_count"]

_DEVICE_FILE = re.compile(r"nvidia\d+")


def driver_gpu_count(dev: Path = Path("/dev"), proc: Path = Path("/proc/driver/nvidia/gpus"),
                     environ: dict[str, str] | None = None) -> int:
    """GPUs the NVIDIA driver exposes here (``/dev/nvidiaN``, ``/proc/driver/nvidia/gpus/*``), at most as many
    as ``CUDA_VISIBLE_DEVICES`` lists when it is set (empty or ``-1``: none). 0 means no driver or no GPU:
    nothing CUDA could use. Reads a few directory entries; imports nothing."""
    environ = dict(os.environ) if environ is None else environ
    try:
        files = sum(1 for entry in dev.iterdir() if _DEVICE_FILE.fullmatch(entry.name))
    except OSError:
        files = 0
    try:
        listed = sum(1 for _ in proc.iterdir())
    except OSError:
        listed = 0
    count = max(files, listed)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [v for v in visible.split(",") if v.strip()]
        # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU.
        valid = len(entries) if "-1" not in entries else entries.index("-1")
        count = min(count, valid)
    return count


def torch_gpu_count() -> int:
    """``torch.cuda.device_count()`` (0 when CUDA is unavailable): what the ranks will see. Imports torch."""
    try:
        import torch
    except ImportError as exc:
        raise ChunkringUsageError(f"torch is not importable ({exc}); reinstall (scripts/main.sh)",
                                  field="torch") from None
    return torch.cuda.device_count() if torch.cuda.is_available() else 0

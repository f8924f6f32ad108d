"""What a fresh interpreter imports: the heavy modules (torch, CUDA, NVSHMEM, MPI) a piece of code pulls in.
Shared by the facade and CLI tests (tests/unit/test_facades.py, test_cli.py)."""

from __future__ import annotations

import ast
import subprocess
import sys

#: What a CPU box without the GPU packages cannot import, and what makes the CLI slow.
HEAVY = ("torch", "cuda", "nvshmem", "mpi4py")


def heavy_modules_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter has imported after running ``code``."""
    probe = (f"{code}\nimport sys\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])
